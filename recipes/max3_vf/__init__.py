"""max3: an environment in verifiers' style (verifiers >= 0.4: a Taskset of typed tasks, rewards as
`@vf.reward` methods, an Env whose `run` is the conversation) for recipes/verifiers-quickstart.yaml.

The task is the quickstart's, `max(a,b,c)=`, read from the repository's data/max3/{split}.jsonl. The
model has `attempts` tries: after a wrong answer the environment says " no. " and poses the task again.
A right answer scores 1.0 at the first attempt and 0.5 at the second (reward `correct`); `attempts`
counts the tries (a metric). With `attempts: 1` it is a single-turn environment.
"""

import json
from pathlib import Path

import verifiers.v1 as vf

DATA = Path(__file__).resolve().parent.parent.parent / "data" / "max3"


class Max3Data(vf.TaskData):
    answer: str


class Max3Task(vf.Task[Max3Data, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: Max3Data, trace: vf.Trace) -> float:
        for tries, reply in enumerate(trace.assistant_messages, start=1):
            if (reply.content or "").strip() == task.answer:
                return 1.0 / tries
        return 0.0

    @vf.metric
    async def attempts(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


class Max3TasksetConfig(vf.TasksetConfig):
    split: str = "train"


class Max3Taskset(vf.Taskset[Max3Task, Max3TasksetConfig]):
    def load(self):
        with open(DATA / f"{self.config.split}.jsonl") as f:
            for line in f:
                row = json.loads(line)
                yield Max3Task(Max3Data(prompt=row["prompt"], answer=row["answer"]), self.config.task)


class Max3EnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    attempts: int = 2


class Max3Env(vf.Env[Max3EnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as talk:
            turn = await talk.turn()
            for _ in range(self.config.attempts - 1):
                if turn.terminated or turn.last_reply.strip() == task.data.answer:
                    break
                turn = await talk.turn(" no. " + task.data.prompt)


__all__ = ["Max3Taskset", "Max3Env"]

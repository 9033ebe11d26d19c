"""The max3 environment: two attempts at the largest of three numbers."""

import random
import re
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from max3_env.models import Max3Action, Max3Observation

ATTEMPTS = 2
REWARDS = {1: 1.0, 2: 0.5}  # a right answer at the first attempt, at the second


class Max3State(State):
    numbers: list[int] = []
    attempts: int = 0


class Max3Environment(Environment):
    """reset(task="max(a,b,c)=") poses that task (or, without one, three numbers drawn from `seed`);
    step(answer) rewards a right one and ends the episode, or asks once more."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session gets its own instance

    def __init__(self):
        super().__init__()
        self._state = Max3State(episode_id=str(uuid4()))

    def reset(self, seed=None, episode_id=None, task: str | None = None, **kwargs) -> Max3Observation:
        numbers = [int(x) for x in re.findall(r"\d+", task or "")][:3]
        if len(numbers) != 3:
            rng = random.Random(seed)
            numbers = [rng.randint(0, 99) for _ in range(3)]
        self._state = Max3State(episode_id=episode_id or str(uuid4()), numbers=numbers)
        return Max3Observation(task=self._task())

    def step(self, action: Max3Action, timeout_s=None, **kwargs) -> Max3Observation:  # type: ignore[override]
        state = self._state
        state.step_count += 1
        state.attempts += 1
        right = action.answer.strip() == str(max(state.numbers))
        if right or state.attempts >= ATTEMPTS:
            return Max3Observation(task=self._task(), done=True, reward=REWARDS[state.attempts] if right else 0.0)
        return Max3Observation(task=self._task(), feedback=" no. ", reward=0.0)

    @property
    def state(self) -> Max3State:
        return self._state

    def _task(self) -> str:
        a, b, c = self._state.numbers
        return f"max({a},{b},{c})="

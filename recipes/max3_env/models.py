"""The max3 environment's action and observation (OpenEnv types: pydantic models)."""

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class Max3Action(Action):
    """An answer to the task."""

    answer: str = Field(..., description="The largest of the three numbers.")


class Max3Observation(Observation):
    """The task, with what the environment said of the last answer (empty at the start)."""

    task: str = Field(default="", description="max(a,b,c)=")
    feedback: str = Field(default="", description="Why another attempt is asked for.")

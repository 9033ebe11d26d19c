"""The max3 environment's server (OpenEnv's FastAPI app): `python -m uvicorn max3_env.server.app:app`."""

from openenv.core.env_server.http_server import create_app

from max3_env.models import Max3Action, Max3Observation
from max3_env.server.max3_environment import Max3Environment

app = create_app(Max3Environment, Max3Action, Max3Observation, env_name="max3", max_concurrent_envs=512)

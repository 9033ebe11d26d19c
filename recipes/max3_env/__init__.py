"""max3: an environment in OpenEnv's style (openenv-core: models, a server-side Environment, its FastAPI
app) for recipes/openenv-quickstart.yaml. The task is the quickstart's, `max(a,b,c)=`; an answer is
rewarded 1.0 at the first attempt and 0.5 at the second, after the environment says it was wrong."""

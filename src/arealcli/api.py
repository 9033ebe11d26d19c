"""The names a plugin needs, in one place (AReaL's `model_api` spelling works too:
`from arealcli import api as model_api`).

    ModelInterface, register_interface     an algorithm: `train_step`, `inference`, `generate`, `save`
    ModelBackend, register_backend         a backend (`capabilities`, `_initialize`)
    TrainEngine, InferenceEngine           the two engine kinds a backend builds (PipelinableEngine:
                                           the original design's name of TrainEngine)
    register_dataset, register_reward      data and reward functions
    register_tool, ToolError               a tool an episode can call: fn(text) -> text
    register_workflow, Episode             an episode workflow: run(engine, tokenizer, prompts, gconfig)
    register_policy_loss                   a policy loss: fn(logp, old_logp, advantages, mask, args,
                                           prox_logp=None) -> (loss, stats); `policy_loss: NAME`
    register_advantage                     an advantage estimator: fn(scores, advantages, mask,
                                           group_ids, args) -> (B, T); `adv_norm: NAME`
    register_kl_estimator                  a per-token KL estimator: fn(logp, ref_logp); `kl_estimator`
    register_preference_loss               a preference loss: fn(pairs, args) -> (loss, chosen_reward,
                                           rejected_reward), each (P,); the dpo interface's `loss: NAME`
    make_interface, make_backend           build one from a `{type_, args}` spec
    SequenceSample, MicroBatchSpec, Model  the data protocol, micro-batch split, a model of the run
"""

from arealcli.runtime.agents.workflows import Episode
from arealcli.runtime.backends.base import ModelBackend
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.engines.inference import GroupGenerator, InferenceEngine
from arealcli.runtime.engines.train import TrainEngine
from arealcli.runtime.interfaces.base import ModelInterface
from arealcli.runtime.models.model import Model
from arealcli.runtime.registry import (
    make_backend,
    make_dataset,
    make_interface,
    register_backend,
    register_dataset,
    register_interface,
    register_reward,
)
from arealcli.runtime.tools import ToolError, register_tool
from arealcli.schema.base import ModelBackendAbstraction, ModelInterfaceAbstraction
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec
from arealcli.schema.registry import (
    register_advantage,
    register_kl_estimator,
    register_policy_loss,
    register_preference_loss,
    register_workflow,
)

PipelinableEngine = TrainEngine  # the original design's name for a training engine

__all__ = [
    "Episode",
    "GenerationHyperparameters",
    "GroupGenerator",
    "InferenceEngine",
    "MicroBatchSpec",
    "Model",
    "ModelBackend",
    "ModelBackendAbstraction",
    "ModelInterface",
    "ModelInterfaceAbstraction",
    "PipelinableEngine",
    "SequenceSample",
    "ToolError",
    "TrainEngine",
    "make_backend",
    "make_dataset",
    "make_interface",
    "register_advantage",
    "register_backend",
    "register_dataset",
    "register_interface",
    "register_kl_estimator",
    "register_policy_loss",
    "register_preference_loss",
    "register_reward",
    "register_tool",
    "register_workflow",
]

"""Run configs: one frozen tree of sections per command, the single home of options and defaults.

    config = lightrft.cli.train_ppo.parse_args(["--pretrain", "model", "--prompt_data", "p.jsonl", ...])
    config = PPORunConfig(model=PPOModelConfig(pretrain="model"), data=PPODataConfig(prompt_data=...))
    config.rollout.temperature          # by section
    config.temperature                  # by flag name (every flag name is unique in a run config)

The command-line parser is generated from the tree (`build_parser`), `--config FILE.yaml` loads
values (flat flag names or nested by section; flags on the command line win), and `to_dict()` /
`to_yaml()` give the resolved options back (what each checkpoint folder keeps as
run_config.yaml). Cross-section checks run on construction, so research code that builds a
config in Python gets the same errors as the command line, each naming the flags and the fix.
"""

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from lightrft.config.options import add_section_flags, flag_fields, section_from_namespace
from lightrft.config.sections import (AgentConfig, AlgorithmConfig, CheckpointConfig, ConfigError, DistributedConfig,
                                      EvalConfig, LoggingConfig, PPODataConfig, PPODistributedConfig, PPOLoggingConfig,
                                      PPOModelConfig, PPOOptimConfig, RewardConfig, RMDataConfig, RMModelConfig,
                                      RMOptimConfig, RolesConfig, RolloutConfig, SFTDataConfig, SupervisedOptimConfig,
                                      ModelConfig, MonitorConfig,
                                      check_bounds, check_distillation, check_finite)


# The parser default that lists a run config's section names, for `--config` files nested by section.
CONFIG_SECTIONS = "_lightrft_config_sections"


@dataclass(frozen=True)
class RunConfig:
    """Base of the per-command run configs: sections as fields, flat read access by flag name."""

    # (section field, --help group title) in --help order
    GROUPS: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: resolve a flag name through the sections.
        if name.startswith("__"):
            raise AttributeError(name)
        for section in self._sections():
            if hasattr(section, name):
                return getattr(section, name)
        raise AttributeError(f"{type(self).__name__} has no option {name!r}")

    def _sections(self):
        return [object.__getattribute__(self, f.name) for f in dataclasses.fields(self)]

    # ------------------------------------------------------------------------------- building
    @classmethod
    def build_parser(cls, prog: str, description: str = "") -> argparse.ArgumentParser:
        """The command's parser: one group per section, one flag per field, and `--config`."""
        parser = argparse.ArgumentParser(prog=prog, description=description,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        for name, title in cls.GROUPS:
            section = cls._section_type(name)
            add_section_flags(parser, section, title, _summary(section))
        parser.add_argument("--config", type=str, default=None, metavar="FILE.yaml",
                            help="read option values from a YAML mapping (flag names without --, flat or nested by "
                                 "section); flags given on the command line override it")
        parser.set_defaults(**{CONFIG_SECTIONS: tuple(cls.sections())})     # the names a nested file may use
        return parser

    @classmethod
    def _section_type(cls, name: str):
        return typing.get_type_hints(cls)[name]

    @classmethod
    def sections(cls) -> dict[str, type]:
        """Section name -> its dataclass."""
        return {f.name: cls._section_type(f.name) for f in dataclasses.fields(cls)}

    def __post_init__(self):
        for section in self._sections():
            check_finite(section)
            check_bounds(section)
            for f in flag_fields(type(section)):
                if f.metadata.get("required") and getattr(section, f.name) is None:
                    raise ConfigError(f"--{f.name} is required: {f.metadata['help']}")

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> "RunConfig":
        """The config of parsed flags (each section from its flags, derived fields filled in)."""
        return cls(**{name: section_from_namespace(section, namespace) for name, section in cls.sections().items()})

    # ------------------------------------------------------------------------------- reading
    def to_dict(self) -> dict[str, Any]:
        """Every flag option as plain values (tuples as lists), flat by flag name."""
        out = {}
        for section in self._sections():
            for f in flag_fields(type(section)):
                value = getattr(section, f.name)
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return dict(sorted(out.items()))

    def to_nested(self) -> dict[str, dict[str, Any]]:
        """Every flag option as plain values, grouped by section (the run_config.yaml layout)."""
        flat = self.to_dict()
        return {f.name: {g.name: flat[g.name] for g in flag_fields(type(getattr(self, f.name)))}
                for f in dataclasses.fields(self)}


def plain_options(args) -> dict[str, Any]:
    """Every option of a run as plain YAML-able values (tuples as lists), flat by flag name: a
    `RunConfig`'s, or the plain attributes of an argparse namespace."""
    if isinstance(args, RunConfig):
        return args.to_dict()
    return {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(vars(args).items())
            if isinstance(v, (str, int, float, bool, list, tuple, type(None))) and not k.startswith("_")}


def _summary(section: type) -> str:
    """The first line of the section's own docstring or its nearest base's (dataclasses give a
    docstring-less class a generated signature instead)."""
    for cls in section.__mro__:
        doc = cls.__dict__.get("__doc__") or ""
        if doc and not doc.startswith(f"{cls.__name__}("):
            return doc.split("\n")[0].rstrip(".")
    return ""


def _section(cls):
    return field(default_factory=cls)


def _check_unique_flags(cls) -> None:
    seen: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        for g in flag_fields(cls._section_type(f.name)):
            if g.name in seen:
                raise TypeError(f"{cls.__name__}: option {g.name!r} is in both {seen[g.name]} and {f.name}")
            seen[g.name] = f.name


def planned_steps(config, num_prompts: int) -> int:
    """Rollout steps of a PPO run over `num_prompts` prompts: whole rollout batches per episode,
    times --num_episodes, capped by --max_steps. `config` is a `PPORunConfig`."""
    optim = config.optim
    steps = num_prompts // config.rollout.rollout_batch_size * optim.num_episodes
    return min(steps, optim.max_steps) if optim.max_steps > 0 else steps


def refuse(what: str, pairs: dict[str, tuple[Any, str]], hint: str) -> None:
    """Raises a ConfigError naming every flag of `pairs` ({flag: (value, reason)}) whose value is
    set, each with its reason, when `what` does not combine with it."""
    used = [(flag, reason) for flag, (value, reason) in pairs.items() if value]
    if used:
        reasons = "; ".join(f"{flag}: {reason}" for flag, reason in used)
        raise ConfigError(f"{what} cannot be combined with {', '.join(flag for flag, _ in used)} ({reasons}); change "
                          f"those flags ({hint}, docs/combinations.md)")


@dataclass(frozen=True)
class PPORunConfig(RunConfig):
    """Everything a `train_ppo` run needs (see docs/configuration.md for each option)."""

    GROUPS: ClassVar = (("distributed", "distributed"), ("model", "models"), ("rollout", "rollout"),
                        ("algorithm", "algorithm"), ("optim", "optimisation"), ("data", "data"),
                        ("rewards", "rewards"), ("logging", "logging"), ("checkpoint", "checkpoint"),
                        ("roles", "explorer and trainer roles"), ("agent", "multi-turn agents"),
                        ("health", "health monitors"))

    distributed: PPODistributedConfig = _section(PPODistributedConfig)
    model: PPOModelConfig = _section(PPOModelConfig)
    rollout: RolloutConfig = _section(RolloutConfig)
    algorithm: AlgorithmConfig = _section(AlgorithmConfig)
    optim: PPOOptimConfig = _section(PPOOptimConfig)
    data: PPODataConfig = _section(PPODataConfig)
    rewards: RewardConfig = _section(RewardConfig)
    logging: PPOLoggingConfig = _section(PPOLoggingConfig)
    checkpoint: CheckpointConfig = _section(CheckpointConfig)
    roles: RolesConfig = _section(RolesConfig)
    agent: AgentConfig = _section(AgentConfig)
    health: MonitorConfig = _section(MonitorConfig)

    def __post_init__(self):
        from lightrft.algorithms.advantages import get_advantage_estimator, validate_group_size

        super().__post_init__()
        # Values derived from other sections.
        algo = dataclasses.replace(self.algorithm, norm_len=self.rollout.generate_max_len,
                                   max_nonfinite_steps=self.checkpoint.max_nonfinite_steps)
        object.__setattr__(self, "algorithm", algo)
        estimator = get_advantage_estimator(algo.advantage_estimator)
        try:
            validate_group_size(algo.advantage_estimator, algo.n_samples_per_prompt)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if estimator.needs_critic and not self.model.critic_pretrain:
            raise ConfigError(f"--advantage_estimator {algo.advantage_estimator} needs a critic: pass "
                              "--critic_pretrain (often the same folder as --pretrain), or choose a critic-free "
                              "estimator such as group_norm")
        if self.model.critic_pretrain and not estimator.needs_critic:
            raise ConfigError(f"--critic_pretrain is set but --advantage_estimator {algo.advantage_estimator} does "
                              "not use a critic; drop --critic_pretrain or use --advantage_estimator gae")
        if not (self.model.reward_pretrain or self.rewards.remote_rm_url or self.data.recorded_data
                or self.model.teacher_pretrain or self.agent.workflow):
            raise ConfigError("no reward source: pass --reward_pretrain and/or --remote_rm_url (or --teacher_pretrain "
                              "to distil from a teacher without a task reward, or a --workflow that returns rewards)")
        check_distillation(self.model.teacher_pretrain, algo)
        if algo.dynamic_sampling and not (self.model.reward_pretrain or self.rewards.remote_rm_url
                                          or self.data.recorded_data or self.agent.workflow):
            raise ConfigError("--dynamic_sampling keeps the groups whose task rewards differ, and this run has no task "
                              "reward (a teacher alone scores every sample 0, so every group would be dropped): add "
                              "--reward_pretrain or --remote_rm_url, or drop --dynamic_sampling")
        if algo.dynamic_sampling and algo.n_samples_per_prompt < 2:
            raise ConfigError("--dynamic_sampling needs --n_samples_per_prompt >= 2 (it drops groups with equal "
                              "rewards)")
        if algo.ptx_coef > 0 and not self.data.pretrain_data:
            raise ConfigError("--ptx_coef > 0 needs --pretrain_data")
        samples = self.rollout.rollout_batch_size * algo.n_samples_per_prompt
        if samples % self.optim.train_batch_size != 0:
            raise ConfigError(f"--rollout_batch_size x --n_samples_per_prompt = {samples} samples per rollout must "
                              f"be a multiple of --train_batch_size {self.optim.train_batch_size}")
        rollbacks = [name for name, action in self.health.actions().items() if action == "rollback"]
        if rollbacks and (self.checkpoint.save_steps < 1 or self.checkpoint.disable_ds_ckpt):
            raise ConfigError(f"--monitors {','.join(f'{n}=rollback' for n in rollbacks)} restores the last healthy "
                              "checkpoint: pass --save_steps N (a checkpoint every N steps) without --disable_ds_ckpt, "
                              "or choose the action stop")
        if self.data.image_key:
            self._check_images()
        if self.distributed.sequence_parallel_size > 1:
            self._check_sequence_parallel()
        if self.optim.micro_train_max_tokens is not None:
            self._check_token_budget()
        if self.model.routing_replay == "rollout":
            self._check_rollout_routes()
        if self.rollout.hf_kv_cache != "dynamic" or self.rollout.hf_compile_decode:
            self._check_hf_decoding()
        roles = self.roles
        if roles.explorer_ranks > 0 or roles.sync_offset > 0:
            self._check_roles()
        elif roles.partial_rollouts or roles.auto_sync_offset or roles.overlap_batches:
            flag = ("--partial_rollouts" if roles.partial_rollouts else "--overlap_batches" if roles.overlap_batches
                    else f"--auto_sync_offset {roles.auto_sync_offset}")
            raise ConfigError(f"{flag} applies to explorers: add --explorer_ranks N or --sync_offset 1, or drop {flag}")
        elif roles.sync_interval > 1:
            raise ConfigError(f"--sync_interval {roles.sync_interval} applies to explorers: add --explorer_ranks N "
                              "(explorer ranks) or --sync_offset 1 (an explorer thread per rank), or leave it at 1")

    def _check_images(self) -> None:
        """What a run with images (--image_key) does not combine with, each refused with the flag
        to change and the reason (docs/combinations.md)."""
        refuse(f"--image_key {self.data.image_key}", {
            "--recorded_data": (self.data.recorded_data, "recorded experiences hold token ids only, not the images "
                                "the policy saw")}, "docs/vlm.md")

    def _check_rollout_routes(self) -> None:
        """--routing_replay rollout replays the routes the Hugging Face engine records while it
        samples; what makes samples another way has none to replay (docs/moe.md)."""
        from lightrft.rollout import engine_capabilities

        engine = self.rollout.rollout_engine
        refuse("--routing_replay rollout", {
            f"--rollout_engine {engine}": (not engine_capabilities(engine).routes, "this engine records no routed "
                                           "experts (lightrft's vLLM engine does not ask vLLM for them: vLLM captures "
                                           "them in its GPU model runner only, which no test here can run); "
                                           "--routing_replay old replays the old-policy forward's routes"),
            "--recorded_data": (self.data.recorded_data, "recorded experiences carry no routes"),
            "--workflow": (self.agent.workflow, "multi-turn episodes are assembled from the turns' tokens, without "
                           "routes; --routing_replay old replays the old-policy forward's routes")},
               "docs/moe.md")

    def _check_hf_decoding(self) -> None:
        """--hf_kv_cache and --hf_compile_decode set the decoding of the Hugging Face engine, the one
        built over the policy's live module; a compiled step must be something a CUDA graph can
        replay (docs/rollout.md)."""
        from lightrft.rollout import engine_capabilities

        engine = self.rollout.rollout_engine
        if not engine_capabilities(engine).shares_live_weights:
            raise ConfigError(f"--hf_kv_cache and --hf_compile_decode set the decoding of the Hugging Face engine; "
                              f"--rollout_engine {engine} holds its own weights and KV cache and does not use them: "
                              "drop them")
        colocated = self.roles.explorer_ranks == 0 and self.roles.sync_offset == 0
        refuse("--hf_compile_decode", {
            "--routing_replay rollout": (self.rollout.hf_compile_decode and self.model.routing_replay == "rollout",
                                         "the routed experts are recorded by hooks that append to a Python list at "
                                         "every step, which a compiled step does not run; --routing_replay old "
                                         "replays the old-policy forward's routes"),
            "--zero_stage 3": (self.rollout.hf_compile_decode and self.distributed.zero_stage == 3 and colocated,
                               "the colocated engine decodes with the partitioned actor, whose forward gathers every "
                               "layer's parameters into fresh buffers, which a CUDA graph cannot replay; use "
                               "--zero_stage 2 or explorer ranks")},
               "docs/rollout.md")

    def _check_token_budget(self) -> None:
        """--micro_train_max_tokens counts the tokens of packed rows; a padded micro-batch pads every
        row to its longest, so its cost is not its tokens."""
        budget = self.optim.micro_train_max_tokens
        if not self.model.packing_samples:
            raise ConfigError(f"--micro_train_max_tokens {budget} budgets the tokens of packed micro-batches: add "
                              "--packing_samples, or drop --micro_train_max_tokens")
        if self.algorithm.ptx_coef > 0:
            raise ConfigError(f"--micro_train_max_tokens {budget} changes the number of micro-batches per optimizer "
                              f"step, and each draws one PTX batch (--ptx_coef {self.algorithm.ptx_coef}): drop one")

    def _check_sequence_parallel(self) -> None:
        """What a row split over ranks (--sequence_parallel_size) needs, named with the flag to change."""
        size = self.distributed.sequence_parallel_size
        if not self.model.packing_samples:
            raise ConfigError(f"--sequence_parallel_size {size} splits packed rows: add --packing_samples")

    def _check_roles(self) -> None:
        """What explorers (ranks, or the threads of the one-step-ahead mode) do not combine with,
        each refused with the flag to change and the reason. Whether the rollout engine can run on
        a thread beside the trainer's is its capability, checked where the thread starts
        (`check_engine_roles`)."""
        mode = (f"--explorer_ranks {self.roles.explorer_ranks}" if self.roles.explorer_ranks else
                f"--sync_offset {self.roles.sync_offset} without --explorer_ranks (an explorer thread per rank)")
        refuse(mode, {
            "--recorded_data": (self.data.recorded_data, "recorded experiences are finished samples: there is "
                                "nothing for explorers to generate"),
            "--vllm_tensor_parallel_size > 1": (self.rollout.vllm_tensor_parallel_size > 1, "an explorer rank holds "
                                                "a whole vLLM engine; run one engine per explorer rank")},
               "docs/async.md")
        if self.roles.partial_rollouts:
            from lightrft.rollout import engine_capabilities

            engine = self.rollout.rollout_engine
            refuse("--partial_rollouts", {
                f"--rollout_engine {engine}": (not engine_capabilities(engine).weight_switch, "this engine cannot "
                                               "take new weights in the middle of a generation"),
                "--image_key": (self.data.image_key, "taking new weights re-reads each sequence so far as tokens, "
                                "without its images"),
                "--routing_replay rollout": (self.model.routing_replay == "rollout", "the routes recorded before new "
                                             "weights arrive are those of the old weights; --routing_replay old "
                                             "replays the trainer's own")},
                   "docs/async.md")
        if self.roles.overlap_batches:
            if not self.roles.partial_rollouts:
                raise ConfigError("--overlap_batches takes new weights between segments, each token tagged with "
                                  "the version that sampled it, which is what --partial_rollouts does: add "
                                  "--partial_rollouts (docs/async.md)")
            refuse("--overlap_batches", {
                "--staleness_policy drop": (self.roles.staleness_policy == "drop", "a batch asked for again would "
                                            "start beside the ones in flight; use --staleness_policy wait"),
                "--dynamic_sampling": (self.algorithm.dynamic_sampling, "its refills are batches asked for out of "
                                       "turn, beside the ones in flight"),
                "--workflow": (self.agent.workflow, "a multi-turn episode's turns wait for its environment, not "
                               "for segments; --partial_rollouts alone takes new weights inside and between turns")},
                   "docs/async.md")

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps per rollout: samples per rollout / --train_batch_size, times --max_epochs."""
        samples = self.rollout.rollout_batch_size * self.algorithm.n_samples_per_prompt
        return samples // self.optim.train_batch_size * self.optim.max_epochs

    def planned_steps(self, num_prompts: int) -> int:
        """Rollout steps of a run over `num_prompts` prompts (see `planned_steps`)."""
        return planned_steps(self, num_prompts)


@dataclass(frozen=True)
class SFTRunConfig(RunConfig):
    """Everything a `train_sft` run needs."""

    GROUPS: ClassVar = (("distributed", "distributed"), ("model", "models"), ("data", "data"),
                        ("eval", "evaluation"), ("optim", "optimisation"), ("logging", "logging"),
                        ("checkpoint", "checkpoint"))

    distributed: DistributedConfig = _section(DistributedConfig)
    model: ModelConfig = _section(ModelConfig)
    data: SFTDataConfig = _section(SFTDataConfig)
    eval: EvalConfig = _section(EvalConfig)
    optim: SupervisedOptimConfig = _section(SupervisedOptimConfig)
    logging: LoggingConfig = _section(LoggingConfig)
    checkpoint: CheckpointConfig = _section(CheckpointConfig)


@dataclass(frozen=True)
class RMRunConfig(RunConfig):
    """Everything a `train_rm` run needs."""

    GROUPS: ClassVar = SFTRunConfig.GROUPS

    distributed: DistributedConfig = _section(DistributedConfig)
    model: RMModelConfig = _section(RMModelConfig)
    data: RMDataConfig = _section(RMDataConfig)
    eval: EvalConfig = _section(EvalConfig)
    optim: RMOptimConfig = _section(RMOptimConfig)
    logging: LoggingConfig = _section(LoggingConfig)
    checkpoint: CheckpointConfig = _section(CheckpointConfig)


for _cls in (PPORunConfig, SFTRunConfig, RMRunConfig):
    _check_unique_flags(_cls)

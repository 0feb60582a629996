"""Validation of a whole config against what is registered: the shell's half of ``xrlhf validate``.

``xrlhf.config`` validates the YAML against the schema and knows no registry (a leaf). Here,
beside the runner, the rest is checked before anything starts, every problem reported at once
as ``dotted.yaml.path: message``:

* the env's and algorithm's options, by the registered class's own ``Config``;
* every engine section by the chosen engine's own ``Options`` (unknown keys rejected; a key
  that belongs to another backend of the role says which), the packages it needs, and where
  it can run (``GenerateEngine.placement_errors``) and what of the ``rollout`` section it
  supports (``GenerateEngine.rollout_errors``);
* a reward function: importable, callable, with a signature it can be called with;
* then, once all of that is valid, the algorithm's cross-section checks;
* then what the run will read, so that nothing fails after Ray has started: every model's
  ``config.json`` (valid JSON, an architecture Transformers knows, with the head the role
  needs), every row of every dataset (all bad rows of a file, capped);
* then the env's own code, called once as the run will call it: its constructor, its prompts,
  an episode's ``start``, the warm-up's demonstrations (``warmup.steps`` > 0), each sandboxed
  tool's start (its import and constructor); a failure is one line naming the method and the
  fix, not a traceback mid-run (an import path that does not import is ``env.name: ...``);
* then the run's memory plan on this machine's GPUs (``plan_errors``; only for handles on a GPU);
* then the longest prompt plus what may follow it (``policy.generate.max_new_tokens``, or an
  episode env's ``max_episode_tokens``) against each model's positions.
  Prompt text the tokenizer cannot read (``<unk>``), and warm-up turns longer than
  ``max_new_tokens``, are warnings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loguru import logger
from pydantic import BaseModel, ValidationError

from xrlhf.config.loader import apply_overrides, format_errors, read_yaml
from xrlhf.config.schema import Section, XConfig
from xrlhf.internals import HOOKS_OFF, unknown_switched_off
from xrlhf.plan import machine
from xrlhf.utils.errors import UserError, first_line


def load_config(path: str | Path, overrides: list[str] | None = None) -> XConfig:
    """Read, override and validate a config; raises ``UserError`` listing every problem."""
    data = apply_overrides(read_yaml(path), list(overrides or []))
    data.setdefault("name", Path(path).stem)
    return validate_dict(data)


def validate_dict(data: dict[str, Any]) -> XConfig:
    """Validate a config dict: the schema, registered options, engines, then cross-checks
    (``layout: auto``: first placed as the planner's fastest layout, ``plan.auto``)."""
    if isinstance(data, dict) and data.get("layout") == "auto":
        from xrlhf.plan.auto import apply_auto_layout

        data = apply_auto_layout(data)
    errors: list[str] = []
    cfg = None
    try:
        cfg = XConfig.model_validate(data)
    except ValidationError as e:
        errors += format_errors(e, XConfig)
    parsed = {}
    for section in ("env", "algorithm"):
        lines, parsed[section] = _validate_registered(section, data.get(section))
        errors += lines
    if cfg is not None:
        errors += engine_errors(cfg) + _transport_errors(cfg) + _reward_function_errors(cfg)
        errors += file_errors(cfg, parsed) + lora_errors(cfg)
    if not errors and cfg is not None:
        errors += _algorithms().get(cfg.algorithm.name).check_config(cfg, parsed["algorithm"])
    if not errors and cfg is not None:
        errors += env_errors(cfg)
    if not errors and cfg is not None and cfg.check_plan:
        errors += plan_errors(cfg)
    errors += [f"{HOOKS_OFF}: no hook is called {name!r}; xrlhf hooks lists them" for name in unknown_switched_off()]
    errors += _setup_hook_errors()
    if errors:
        raise UserError(*errors)
    return cfg


def _setup_hook_errors() -> list[str]:
    """``XRLHF_WORKER_SETUP`` names a function that resolves here (the workers resolve it again)."""
    from xrlhf.engines.host import setup_hook

    try:
        setup_hook()
    except UserError as e:
        return e.messages
    return []


def algorithm_options(cfg: XConfig) -> BaseModel:
    """The validated options of ``cfg.algorithm`` (its class's ``Config``)."""
    return _algorithms().get(cfg.algorithm.name).Config.model_validate(cfg.algorithm.options())


def _algorithms():
    from xrlhf.algorithms import ALGORITHMS

    return ALGORITHMS


def _validate_registered(section: str, raw: Any) -> tuple[list[str], BaseModel | None]:
    """The options of the named env or algorithm, validated by the class's own ``Config``."""
    from xrlhf.envs import ENVS

    if raw is None and section == "algorithm":
        raw = {"name": "ppo"}  # the schema's default section
    if not isinstance(raw, dict) or not isinstance(raw.get("name", "ppo" if section == "algorithm" else None), str):
        return [], None  # the schema already reported it
    registry = ENVS if section == "env" else _algorithms()
    name = raw.get("name", "ppo")
    try:
        cls = registry.get(name)
    except KeyError as e:
        return [f"{section}.name: {e.args[0]}"], None
    if section == "env":
        options, prefix = raw.get("options") or {}, "env.options"
        if not isinstance(options, dict):
            return [], None
    else:
        options, prefix = {k: v for k, v in raw.items() if k != "name"}, "algorithm"
    try:
        return [], cls.Config.model_validate(options)
    except ValidationError as e:
        return format_errors(e, cls.Config, prefix), None


def engine_errors(cfg: XConfig) -> list[str]:
    """Every engine section checked by its engine: name, packages, options, placement."""
    errors = []
    for path, role, section in cfg.engine_sections():
        errors += _section_errors(cfg, path, role, section)
    return errors


def _section_errors(cfg: XConfig, path: str, role: str, section: Section) -> list[str]:
    from xrlhf.engines.base import engine_class

    try:
        cls = engine_class(section.engine, role)  # type: ignore[arg-type]
    except KeyError as e:
        return [f"{path}.engine: {e.args[0]}" + _other_roles(section.engine, role)]
    errors = []
    missing = cls.missing_packages()
    if missing:
        how = f"pip install -e '.[{cls.pip_extra}]'" if cls.pip_extra else "pip install " + " ".join(missing)
        errors.append(f"{path}.engine: {section.engine!r} needs the {', '.join(missing)} package; install it with "
                      f"{how}")
    errors += [f"{path}.engine: {section.engine!r}: {problem}" for problem in cls.version_errors()]
    fields = section.engine_fields()
    for key in sorted(set(fields) - set(cls.Options.model_fields)):
        owners = _backends_with_option(role, key)
        if owners:
            errors.append(f"{path}.{key}: an option of engine {' or '.join(map(repr, owners))}, but {path}.engine is "
                          f"{section.engine!r}; remove it or set {path}.engine: {owners[0]}")
            del fields[key]
    try:
        options = cls.Options.model_validate(fields, context={"path": path})
    except ValidationError as e:
        return errors + format_errors(e, cls.Options, path)
    if role == "generate":
        split = cfg.policy.generate.resources is not None
        res = cfg.policy.generate.resources if split else cfg.policy.resources
        where = "policy.generate.resources" if split else "policy.resources"
        errors += cls.placement_errors(options, where, res.gpus_per_rank, split)
        errors += cls.rollout_errors(options, cfg.rollout, rollout_plan(cfg, split))
        adapter = _policy_adapter(cfg)
        if adapter is not None and adapter.sync == "adapter":
            errors += cls.adapter_errors(options, adapter)
    return errors


def _other_roles(engine: str, role: str) -> str:
    """For a backend that has engines of other roles only: what that means (an infer section's
    backend that only generates cannot return the logprobs of given tokens)."""
    from xrlhf.engines.base import engine_names

    roles = ("train", "infer", "generate")
    others = [r for r in roles if r != role and engine in engine_names(r)]  # type: ignore[arg-type]
    if not others:
        return ""
    what = " (it cannot score given tokens: no logprobs of another model's samples)" if role == "infer" else ""
    return f"; {engine!r} has {' and '.join(others)} engines only{what}"


def _policy_adapter(cfg: XConfig):
    """The policy's LoRA options, or ``None`` (also when its train section is invalid: reported by itself)."""
    from xrlhf.topology import policy_adapter

    try:
        return policy_adapter(cfg)
    except (KeyError, ValidationError):
        return None


def lora_errors(cfg: XConfig) -> list[str]:
    """LoRA against the rest of the run: each train section's targets against its model (the
    engine's ``model_errors``), the reference as the policy's base, the warm-up."""
    from xrlhf.engines.base import engine_class
    from xrlhf.topology import reference_is_policy_base

    errors = []
    try:
        head = _algorithms().get(cfg.algorithm.name).policy_head
    except KeyError:
        head = "causal_lm"
    sections = [("policy.train", cfg.policy.train, cfg.policy.model, head)]
    if cfg.critic is not None:
        sections.append(("critic.train", cfg.critic.train, cfg.critic.model or cfg.policy.model, "value"))
    for path, section, model_dir, model_head in sections:
        try:
            cls = engine_class(section.engine, "train")
            options = cls.Options.model_validate(section.engine_fields(), context={"path": path})
        except (KeyError, ValidationError):
            continue  # reported by engine_errors
        if not model_errors(path, model_dir, model_head):
            errors += cls.model_errors(options, path, model_dir, model_head)
    adapter = _policy_adapter(cfg)
    r = cfg.reference
    if r is not None and r.from_policy_base and adapter is None:
        errors.append("reference.from_policy_base: the policy trains every weight (no policy.train.lora), so it keeps "
                      "no base to compute the reference with; remove it (the reference is then a model of its own)")
    elif r is not None and adapter is not None and reference_is_policy_base(cfg):
        unused = [k for k in ("model", "infer", "resources") if k in r.model_fields_set]
        errors += [f"reference.{k}: not used: the reference is the policy's base with its LoRA adapters off "
                   f"(policy.train.lora); remove it, or set reference.from_policy_base: false for a reference model "
                   f"of its own" for k in unused]
        for h in ("critic", "reward"):
            sec = getattr(cfg, h)
            if sec is not None and sec.resources.colocate_with == "reference":
                errors.append(f"{h}.resources.colocate_with: the reference is the policy's base and has no workers "
                              f"of its own; colocate with policy")
    if cfg.warmup.lora and adapter is None:
        errors.append("warmup.lora: warms up with the policy's LoRA adapters, but policy.train has no lora section; "
                      "remove it")
    return errors


def rollout_plan(cfg: XConfig, split: bool):
    """The layout, and for an asynchronous co-located rollout on a GPU the memory the generator
    must leave to the trainer: the device's total (when this process sees a GPU) and the
    estimated peak of the policy's training plus a reference on the same GPU."""
    from xrlhf.engines.base import RolloutPlan

    if split or cfg.rollout.max_staleness == 0 or cfg.policy.resources.gpus_per_rank == 0:
        return RolloutPlan(split)
    device = machine.gpu_total_gib()
    return RolloutPlan(split, device, _trainer_gib(cfg) if device else None)


def plan_errors(cfg: XConfig, gpu_gib: float | None = None) -> list[str]:
    """The run's plan (``xrlhf.plan``) on this machine: one line naming the phase, the handles
    and the numbers when the configured layout does not fit its GPUs. Only where a handle is
    placed on a GPU and this process sees one (``gpu_gib``: its memory; default: the first
    GPU's, from ``nvidia-smi``): a CPU run has no GPU memory to check."""
    from xrlhf.plan import Cluster, fit_errors, gpus_asked, plan_input
    from xrlhf.topology import on_gpu, placements

    placed = placements(cfg)
    if not any(on_gpu(placed, h) for h in placed):
        return []
    gpu_gib = gpu_gib or machine.gpu_total_gib()
    if not gpu_gib:
        return []
    try:
        inp = plan_input(cfg)
    except UserError as e:
        return e.messages
    return fit_errors(inp, Cluster(gpus_asked(inp), 1, gpu_gib))


def _trainer_gib(cfg: XConfig) -> float | None:
    """The policy's estimated training peak on its GPU (GiB), with what shares that GPU; ``None``
    when the model cannot be read (``model_errors`` says why). Not cached: a config is not hashable."""
    from transformers import AutoConfig

    from xrlhf.engines.training import estimate_train_gib
    from xrlhf.models.tiny import count_params

    try:
        mc = AutoConfig.from_pretrained(cfg.policy.model)
        params = count_params(cfg.policy.model)
    except Exception:  # noqa: BLE001 - reported by model_errors
        return None
    from xrlhf.engines.lora import adapter_params
    from xrlhf.topology import reference_is_policy_base

    train = cfg.policy.train
    dtype = 2 if train.dtype == "bfloat16" else 4
    separate_ref = cfg.reference is not None and not reference_is_policy_base(cfg)
    frozen = params if separate_ref and cfg.reference.resources.colocate_with == "policy" else 0
    adapter, trained = _policy_adapter(cfg), params
    if adapter is not None:  # LoRA: the base is frozen, only the adapters have gradients and Adam states
        frozen, trained = frozen + params, adapter_params(cfg.policy.model, "causal_lm", adapter)
    t = cfg.teacher
    if t is not None and t.resources.colocate_with == "policy":  # its infer engine, and a generator to evaluate it
        frozen += count_params(t.model) * (2 if t.evaluate else 1)
    seq = 64 + cfg.policy.generate.max_new_tokens  # a typical prompt and the longest response
    width = getattr(mc, "intermediate_size", None)
    gib = estimate_train_gib(trained, dtype, train.micro_batch_size, seq, mc.hidden_size, mc.num_hidden_layers,
                             mc.vocab_size, frozen, width)
    if cfg.critic is not None and cfg.critic.resources.colocate_with == "policy":  # a second trainer, no logits
        gib += estimate_train_gib(params, dtype, cfg.critic.train.micro_batch_size, seq, mc.hidden_size,
                                  mc.num_hidden_layers, 0, intermediate=width)
    return gib


def _backends_with_option(role: str, key: str) -> list[str]:
    """Registered backends of ``role`` whose options have a field ``key``."""
    from xrlhf.engines.base import engine_class, engine_names

    return [n for n in engine_names(role) if key in engine_class(n, role).Options.model_fields]  # type: ignore[arg-type]


def _transport_errors(cfg: XConfig) -> list[str]:
    """``policy.weight_sync``: a registered transport (or ``auto``) that fits the layout, and its
    own options (``weight_sync.transport_errors``)."""
    from xrlhf.topology import colocated, on_gpu, placements
    from xrlhf.weight_sync import transport_errors

    try:
        ws, placed = cfg.policy.weight_sync, placements(cfg)
        together = colocated(cfg)
    except (KeyError, ValidationError, UserError):
        return []  # a section the layout depends on is invalid: reported by itself
    gpu = on_gpu(placed, "policy") and on_gpu(placed, "rollout")
    return transport_errors(ws.transport, ws.transport_options(), together, gpu)


def _reward_function_errors(cfg: XConfig) -> list[str]:
    from xrlhf.algorithms.rewards import load_reward_function

    if cfg.reward.source == "function" and cfg.reward.function:
        try:
            load_reward_function(cfg.reward.function)
        except UserError as e:
            return e.messages
    return []


def file_errors(cfg: XConfig, parsed: dict[str, BaseModel | None]) -> list[str]:
    """Every model's ``config.json`` and every row of every dataset the run will read."""
    try:
        head = _algorithms().get(cfg.algorithm.name).policy_head
    except KeyError:
        head = "causal_lm"  # the unknown name is reported by itself
    errors = [e for path, model_dir, head in _models(cfg, head) for e in model_errors(path, model_dir, head)]
    return errors + _dataset_errors(cfg, parsed)


def env_errors(cfg: XConfig) -> list[str]:
    """The env built and used as the run will, then its longest prompt against the models'
    positions. The env's own code (its constructor, prompts, ``start``, warm-up demonstrations,
    tools) runs here once, so that a failure is one line naming the method and the fix before
    anything is created, not a traceback in the middle of a run."""
    from xrlhf.envs import build_env

    trainer = _algorithms().get(cfg.algorithm.name)
    models = _models(cfg, trainer.policy_head)
    try:
        env = build_env(cfg.env.name, cfg.env.options, cfg.seed)
    except Exception as e:  # noqa: BLE001 - the user's constructor: name it
        return [f"env.name: env {cfg.env.name!r} could not be built: {_raised(e)}; fix its constructor (__init__)"]
    errors = user_code_errors(cfg, env)
    if errors:
        return errors
    name = cfg.env.name
    try:
        tokenizer = _tokenizer(cfg.policy.model)
        _user_call(f"env.name: env {name!r}: reading its prompts", lambda: _warn_unknown_text(env, tokenizer, name))
        if not trainer.uses_generation:
            return []
        _user_call(f"warmup.steps: env {name!r}: its warm-up demonstrations",
                   lambda: _warn_short_turns(cfg, env, tokenizer))
        if getattr(env, "multi_turn", False) and not getattr(tokenizer, "chat_template", None):
            return [f"policy.model: {cfg.policy.model} has no chat template, and env {name!r} runs chat "
                    f"episodes; add a chat_template.jinja to the model directory (the tiny models of "
                    f"`xrlhf make-tiny-model` have one: rebuild it)"]
        longest = _user_call(f"env.name: env {name!r}: max_prompt_tokens", lambda: env.max_prompt_tokens(tokenizer))
    except UserError as e:
        return e.messages
    from xrlhf.data.lengths import length_error

    episode = getattr(env, "multi_turn", False)
    follows = env.config.max_episode_tokens if episode else cfg.policy.generate.max_new_tokens
    lines = [length_error(d, longest, follows, f"the longest prompt of env {cfg.env.name!r}", episode=episode)
             for _, d, _ in models]
    return list(dict.fromkeys(x for x in lines if x))


def user_code_errors(cfg: XConfig, env) -> list[str]:
    """What the run will call of the env's own code, called once here: ``eval_prompts``,
    ``train_prompts``, an episode's ``start``, the warm-up's demonstrations (``warmup.steps`` >
    0) and the start of each sandboxed tool. The first failure, in one line naming the method."""
    from xrlhf.envs.base import Prompt
    from xrlhf.envs.episode import Episode, is_episode_env

    where = f"env.name: env {cfg.env.name!r}"
    prompts = []
    for what, call in (("eval_prompts()", env.eval_prompts), ("train_prompts(0, 4)", lambda: env.train_prompts(0, 4))):
        try:
            got = call()
        except UserError as e:  # the env's own lines (a dataset's bad rows): already name the place and the fix
            return e.messages
        except Exception as e:  # noqa: BLE001 - the user's code: name it
            return [f"{where}: {what} raised {_raised(e)}; fix the env"]
        if not isinstance(got, list) or not all(isinstance(p, Prompt) for p in got):
            return [f"{where}: {what} returned {_kinds(got)}, expected a list of xrlhf.envs.Prompt"]
        prompts += got
    if is_episode_env(env) and prompts:
        try:
            episode = env.start(prompts[0])
        except Exception as e:  # noqa: BLE001
            return [f"{where}: start() of prompt {prompts[0].text[:40]!r} raised {_raised(e)}; fix the env's start "
                    f"(it begins every episode)"]
        if not isinstance(episode, Episode):
            return [f"{where}: start() returned {type(episode).__name__}, expected an xrlhf.envs.episode.Episode"]
    if cfg.warmup.steps:
        what = "sft_conversations(0, 1)" if is_episode_env(env) else "sft_examples(0, 1)"
        try:
            env.sft_conversations(0, 1) if is_episode_env(env) else env.sft_examples(0, 1)
        except NotImplementedError as e:
            return [f"warmup.steps: {cfg.warmup.steps} warm-up steps, but {first_line(e)}"]
        except Exception as e:  # noqa: BLE001
            return [f"warmup.steps: env {cfg.env.name!r}: {what} (the warm-up's demonstrations) raised {_raised(e)}; "
                    f"fix the env, or set warmup.steps: 0"]
    return _tool_start_errors(env)


def _tool_start_errors(env) -> list[str]:
    """Each sandboxed tool of a tool env started once: its import and constructor run there."""
    from xrlhf.envs.tool_use import ToolEnvOptions
    from xrlhf.tools.build import build_tool
    from xrlhf.tools.sandbox import SandboxedTool, ToolStartError

    if not isinstance(env.config, ToolEnvOptions):
        return []
    errors = []
    for i, spec in enumerate(env.config.tools):
        tool = build_tool(spec.name, spec.options)
        if isinstance(tool, SandboxedTool):
            try:
                tool.start()
            except ToolStartError as e:
                errors.append(f"env.options.tools[{i}]: tool {tool.name!r} could not start in its sandbox: {e}")
            finally:
                tool.close()
    return errors


def _user_call(where: str, fn):
    """``fn()``; an exception of the user's code in it becomes ``UserError("<where> raised ...")``."""
    try:
        return fn()
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code: name it, no traceback
        raise UserError(f"{where} raised {_raised(e)}; fix the env") from None


def _raised(e: BaseException) -> str:
    return f"{type(e).__name__}: {first_line(e)}"


def _kinds(value: Any) -> str:
    if isinstance(value, list):
        return "a list of " + ", ".join(sorted({type(v).__name__ for v in value})) if value else "an empty list"
    return f"a {type(value).__name__}"


def _models(cfg: XConfig, policy_head: str) -> list[tuple[str, str, str]]:
    """``(yaml path, directory, head)`` of every model the run loads (defaults are the policy's)."""
    out = [("policy.model", cfg.policy.model, policy_head)]
    if cfg.critic is not None and cfg.critic.model:
        out.append(("critic.model", cfg.critic.model, "value"))
    if cfg.reference is not None and cfg.reference.model:
        out.append(("reference.model", cfg.reference.model, "causal_lm"))
    if cfg.reward.source == "model" and cfg.reward.model:
        out.append(("reward.model", cfg.reward.model, "score"))
    if cfg.teacher is not None:
        out.append(("teacher.model", cfg.teacher.model, "causal_lm"))
    return out


HEAD_CLASSES = {"causal_lm": "AutoModelForCausalLM", "value": "AutoModelForTokenClassification",
                "score": "AutoModelForSequenceClassification"}


def model_errors(path: str, model_dir: str, head: str) -> list[str]:
    """One line if ``model_dir/config.json`` is not a config Transformers can load with ``head``."""
    import json

    from transformers import AutoConfig
    from transformers.models.auto import configuration_auto, modeling_auto

    file = Path(model_dir) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except ValueError as e:
        return [f"{path}: {file} is not valid JSON ({e})"]
    if not isinstance(raw, dict):
        return [f"{path}: {file} must hold a JSON object, got {type(raw).__name__}"]
    model_type = raw.get("model_type")
    if model_type not in configuration_auto.CONFIG_MAPPING_NAMES:
        import transformers

        return [f"{path}: model_type {model_type!r} in {file} is not an architecture Transformers "
                f"{transformers.__version__} knows (e.g. llama, qwen2, mistral, gemma2, gpt2)"]
    names = {"causal_lm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
             "value": modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
             "score": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES}[head]
    if model_type not in names:
        return [f"{path}: Transformers has no {HEAD_CLASSES[head]} for model_type {model_type!r} ({file}); the "
                f"{head} head needs one"]
    try:
        AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - Transformers raises many kinds; the first line says which
        return [f"{path}: {file}: {first_line(e)}"]
    return []


def _tokenizer(model_dir: str):
    from xrlhf.data.text import load_tokenizer

    try:
        return load_tokenizer(model_dir)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"policy.model: cannot load the tokenizer saved in {model_dir} ({first_line(e)})") from None


def _dataset_errors(cfg: XConfig, parsed: dict[str, BaseModel | None]) -> list[str]:
    """Every bad row of every dataset an option of the env or the algorithm names."""
    from xrlhf.data.datasets import dataset_errors
    from xrlhf.envs import ENVS

    errors = []
    for section, registry, name in (("env.options", ENVS, cfg.env.name),
                                    ("algorithm", _algorithms(), cfg.algorithm.name)):
        options = parsed["env" if section == "env.options" else "algorithm"]
        if options is None:  # invalid options: reported by themselves
            continue
        schema = getattr(registry.get(name), "schema", None)
        if schema is None:
            continue
        for field, info in type(options).model_fields.items():
            value = getattr(options, field)
            if value and _is_dataset_path(info.annotation, info.metadata):
                errors += [f"{section}.{field}: {line}" for line in dataset_errors(value, schema)]
    return errors


def _is_dataset_path(annotation: Any, metadata: list) -> bool:
    """Whether a field is typed ``DatasetPath`` (or ``DatasetPath | None``)."""
    import typing

    from xrlhf.data.datasets import DatasetPath

    check = typing.get_args(DatasetPath)[1].func
    if any(getattr(m, "func", None) is check for m in metadata):
        return True
    return any(getattr(m, "func", None) is check for a in typing.get_args(annotation)
               for m in getattr(a, "__metadata__", ()))


def _warn_unknown_text(env, tokenizer, name: str, sample: int = 256) -> None:
    """A warning when prompts hold characters the tokenizer maps to ``<unk>`` (the model cannot read them)."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return
    for p in [*env.eval_prompts(), *env.train_prompts(0, sample)]:
        if unk in tokenizer.encode(p.text, add_special_tokens=False):
            chars = sorted({c for c in p.text if tokenizer.encode(c, add_special_tokens=False) == [unk]})
            logger.warning(f"env {name!r}: prompt {p.text[:60]!r} has characters the policy's tokenizer maps to "
                           f"{tokenizer.unk_token} ({''.join(chars)!r}): the model cannot tell them apart")
            return


def _warn_short_turns(cfg: XConfig, env, tokenizer, sample: int = 64) -> None:
    """A warning when the warm-up teaches turns longer than ``policy.generate.max_new_tokens``:
    the policy then starts turns it cannot finish, and each is cut off (a truncated sample)."""
    from xrlhf.envs.episode import is_episode_env

    if not cfg.warmup.steps:
        return
    if is_episode_env(env):
        turns = [m["content"] for c in env.sft_conversations(0, sample) for m in c if m["role"] == "assistant"]
    else:
        turns = [target for _, target in env.sft_examples(0, sample)]
    longest = max((len(tokenizer.encode(t, add_special_tokens=False)) + 1 for t in turns), default=0)
    limit = cfg.policy.generate.max_new_tokens
    if longest > limit:
        logger.warning(f"policy.generate.max_new_tokens: {limit} is shorter than the longest turn the warm-up teaches "
                       f"(about {longest} tokens with its end token, in the env's first {sample} demonstrations): such "
                       f"turns are cut off and the sample truncated (see episode/truncated_frac); raise it to at least "
                       f"{longest}")

"""The offline API: ``from inferhal import LLM, SamplingParams``.

>>> llm = LLM(model="gemma3_270m", backend="reference", dtype="float32", max_model_len=2048)
>>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0.0))
>>> out[0].text, out[0].token_ids, out[0].finish_reason

Construction:

- ``LLM(model=NAME)``: a config in ``conf/model/``; ``LLM(model=DIR_OR_GGUF)``: a checkpoint, whose
  family is read from its ``config.json`` (``model_type``) or its ``.gguf`` suffix.
- ``LLM(loaded_model=LoadedModel, active_backend=ActiveBackend)``: a prebuilt model (tests, other
  helpers). Keyword overrides still configure the scheduler and cache.
- Keyword overrides name any field of the model, scheduler, cache or root config
  (``dtype="float32"``, ``max_model_len=512``, ``max_num_seqs=8``, ``enable_prefix_caching=False``,
  ``block_size=32``, ``policy="priority"``), or a dotted path (``overrides=["cache.num_blocks=64"]``).

``generate`` validates every request before any runs and raises the first bad one's error (a
``ValueError``, like vLLM's ``add_request``); to report bad requests one by one while the rest run, use
``llm.engine.add_request`` (which raises for that request only) and ``llm.engine.step()``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator, Optional, Sequence, Union

from inferhal.core.config import schema
from inferhal.core.engine.engine import Engine, Prompt
from inferhal.core.engine.outputs import RequestOutput
from inferhal.core.errors import UserError
from inferhal.core.sampling.params import SamplingParams
from inferhal.core.scheduler.scheduler import RequestError

_SECTIONS = {"model": schema.ModelConfig, "scheduler": schema.SchedulerConfig, "cache": schema.CacheConfig,
             "backend": schema.BackendConfig}
_ROOT = {f.name for f in dataclasses.fields(schema.InferhalConfig)} - set(_SECTIONS)
_FAMILY_BASE = {"gemma3": "gemma3_270m", "deepseek_v4": "deepseek_v4_flash", "llama": "smollm2_135m_instruct"}
_GGUF_ARCHS = {"gemma3": "gemma3", "llama": "llama"}  # general.architecture of a .gguf → family
_MODEL_TYPES = {"gemma3": "gemma3", "gemma3_text": "gemma3", "deepseek_v4": "deepseek_v4", "deepseek_v3": "deepseek_v4"}


def _key_path(key: str) -> str:
    if "." in key:
        return key
    for sec, cls in _SECTIONS.items():
        if key in {f.name for f in dataclasses.fields(cls)}:
            return f"{sec}.{key}"
    if key in _ROOT:
        return key
    known = sorted({f.name for c in _SECTIONS.values() for f in dataclasses.fields(c)} | _ROOT)
    raise UserError(f"LLM: unknown option {key!r}; known options: {', '.join(known)}")


def _checkpoint_overrides(path: str) -> tuple[str, dict[str, Any]]:
    """(model config to start from, fields to set) for a checkpoint directory or GGUF file."""
    name = os.path.basename(os.path.normpath(path))
    if path.endswith(".gguf"):
        from inferhal.core.models.gguf.reader import GGUFFile

        arch = GGUFFile(path).metadata.get("general.architecture")
        if arch not in _GGUF_ARCHS:
            raise UserError(f"LLM: GGUF {path!r} has architecture {arch!r}; supported: {', '.join(_GGUF_ARCHS)}")
        family, fmt = _GGUF_ARCHS[arch], "gguf"
    else:
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise UserError(f"LLM: {path!r} is a directory without config.json; pass a config name or a checkpoint")
        with open(cfg_file) as f:
            mt = json.load(f).get("model_type", "")
        if mt not in _MODEL_TYPES:
            raise UserError(f"LLM: checkpoint {path!r} has model_type {mt!r}; supported: {', '.join(_MODEL_TYPES)}")
        family, fmt = _MODEL_TYPES[mt], "hf"
    return _FAMILY_BASE[family], {"model.path": path, "model.format": fmt, "model.package": None, "model.name": name}


def compose_config(model: Optional[str] = None, backend: Optional[str] = None, overrides: Sequence[str] = (), *,
                   command: str = "generate", **options: Any):
    """The composed root config of an LLM (see the module docstring for the options). ``command``: whose reads
    decide which fields may be set (core/config/reads.py): ``generate`` for a job or its ranks (parallel, eplb,
    prompts, sampling), ``LLM`` for ``LLM(...)`` itself, which reads the engine's fields only."""
    from inferhal.core.config.compose import compose

    hydra_ov = list(overrides)
    sets: dict[str, Any] = {}
    if model is not None:
        if os.path.exists(model):
            base, sets = _checkpoint_overrides(model)
            hydra_ov.insert(0, f"model={base}")
        else:
            hydra_ov.insert(0, f"model={model}")
    if backend is not None:
        hydra_ov.insert(0, f"backend={backend}")
    for k, v in options.items():
        sets[_key_path(k)] = v
    return compose(hydra_ov, command=command, updates=sets)


def _to(cls, node):
    return cls(**{f.name: node[f.name] for f in dataclasses.fields(cls) if f.name in node})


class LLM:
    def __init__(self, model: Optional[str] = None, backend: Optional[str] = "reference", *,
                 loaded_model: Any = None, active_backend: Any = None, overrides: Sequence[str] = (),
                 **options: Any) -> None:
        cfg = compose_config(model if loaded_model is None else None,
                             backend if active_backend is None else None, overrides, command="LLM", **options)
        # (a parallel layout is refused at compose: this object is one process, LLM reads no parallel field)
        len_set = "max_model_len" in options or any(o.split("=", 1)[0].lstrip("+~") == "model.max_model_len"
                                                    for o in overrides)
        # a checkpoint path without a length: up to its family config's max_model_len, within its own context
        self._build(cfg, loaded_model, active_backend, "max_model_len" in options,
                    clamp=loaded_model is None and model is not None and os.path.exists(model) and not len_set)

    @classmethod
    def from_config(cls, cfg, loaded_model: Any = None, active_backend: Any = None) -> "LLM":
        """An LLM from an already composed root config (the CLI's path)."""
        self = cls.__new__(cls)
        self._build(cfg, loaded_model, active_backend, False)
        return self

    def _build(self, cfg, loaded_model, active_backend, len_override: bool, clamp: bool = False) -> None:
        from inferhal.core.spec.ngram import check_spec_config

        check_spec_config(_to(schema.SpecConfig, cfg.spec))  # a bad spec config fails before anything loads
        injected = loaded_model
        self.config = cfg
        deterministic = bool(cfg.get("deterministic", False))
        if active_backend is None:
            from inferhal.core.registry import BackendRegistry

            registry, bcfg = BackendRegistry.discover(), _to(schema.BackendConfig, cfg.backend)
            if deterministic:  # batch-invariant ops, or a refusal naming the ops that cannot be
                registry.check_deterministic(bcfg)
                bcfg = dataclasses.replace(bcfg, batch_invariant=True)
            active_backend = registry.select(bcfg)
        elif deterministic and not active_backend.profile.supports("batch_invariant"):
            raise UserError(f"deterministic=true: the given backend {active_backend.name!r} was selected without "
                            f"batch-invariant ops (backend.batch_invariant=true)")
        kv_dtype = str(cfg.cache.kv_dtype)
        if kv_dtype != "auto":  # before loading: a KV format the backend cannot read or the family cannot store
            from inferhal.core.models.registry import kv_dtypes
            from inferhal.core.paging.formats import check_backend

            check_backend(active_backend.name, active_backend.profile, kv_dtype)
            if loaded_model is None and kv_dtype not in kv_dtypes(cfg.model):
                raise UserError(f"cache.kv_dtype={kv_dtype} is refused: model {cfg.model.name!r} (family "
                                f"{cfg.model.family!r}) stores its KV as {', '.join(kv_dtypes(cfg.model))} only; "
                                f"FP8/FP4 KV records exist for the deepseek_v4 family")
        if loaded_model is None:
            from inferhal.core.models.registry import load_model

            try:
                loaded_model = load_model(_to(schema.ModelConfig, cfg.model), active_backend)
            except ImportError as exc:  # a family whose loader is not in this build
                raise UserError(f"model {cfg.model.name!r} (family {cfg.model.family!r}) cannot be loaded in this "
                                f"build: {exc}") from None
        max_len = int(loaded_model.model.max_model_len)
        if injected is None or len_override:  # the config's limit applies to a config model
            if not clamp:  # past the model's own context only with model.allow_long_context
                from inferhal.core.config.context import check_loaded

                check_loaded(cfg.model, loaded_model)
            max_len = min(max_len, int(cfg.model.max_model_len))
        self.engine = Engine(loaded_model, active_backend, _to(schema.SchedulerConfig, cfg.scheduler),
                             _to(schema.CacheConfig, cfg.cache), max_model_len=max_len, seed=int(cfg.seed),
                             spec=_to(schema.SpecConfig, cfg.spec), deterministic=deterministic)
        self.tokenizer = loaded_model.tokenizer

    @classmethod
    def from_loaded(cls, loaded_model: Any, active_backend: Any, **options: Any) -> "LLM":
        """An LLM over a prebuilt model and backend (no config model, no loading)."""
        return cls(loaded_model=loaded_model, active_backend=active_backend, **options)

    # ------------------------------------------------------------------ generation

    def _requests(self, prompts, sampling_params, priority):
        served = getattr(self, "served_by", None)  # make_app's AsyncEngine, once this LLM is served
        if served is not None and served.alive:  # two threads stepping one engine would mix their batches
            raise UserError("this LLM's engine is being served (inferhal serve / make_app runs it on its own "
                            "thread): send requests to the server, or stop it before calling generate/stream/chat")
        if not isinstance(prompts, (str, list, tuple)):
            raise RequestError(f"prompts must be a string, a list of token ids, or a list of those; got "
                               f"{type(prompts).__name__}")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        if priority is not None:
            params = [dataclasses.replace(p, priority=int(q)) for p, q in zip(params, priority)]
        reqs = []
        for i, (pr, sp) in enumerate(zip(prompts, params)):
            try:
                reqs.append(self.engine.make_request(pr, sp))
            except ValueError as exc:
                raise type(exc)(f"prompt {i}: {exc}") from None
        return reqs

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]], sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 priority: Optional[Sequence[int]] = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order. Raises before running if any is bad."""
        reqs = self._requests(prompts, sampling_params, priority)
        order = [self.engine.add(r) for r in reqs]
        done: dict[str, RequestOutput] = {}
        try:
            while len(done) < len(order):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
        except BaseException:
            self.engine.abort([r for r in order if r not in done])
            raise
        return [done[r] for r in order]

    def stream(self, prompts: Union[Prompt, Sequence[Prompt]], sampling_params=None,
               priority: Optional[Sequence[int]] = None) -> Iterator[RequestOutput]:
        """An iterator of outputs (with ``new_token_ids`` / ``new_text``), one every time a request gets
        tokens. Raises here, before any output, if any request is bad (as :meth:`generate` does)."""
        return self._stream(self._requests(prompts, sampling_params, priority))

    def _stream(self, reqs) -> Iterator[RequestOutput]:
        order = [self.engine.add(r) for r in reqs]
        self.engine.stream_text = True
        left = set(order)
        try:
            while left:
                for out in self.engine.step():
                    if out.finished:
                        left.discard(out.request_id)
                    yield out
        finally:
            self.engine.stream_text = False
            if left:
                self.engine.abort(list(left))

    def chat(self, messages: Sequence[dict], sampling_params: Optional[SamplingParams] = None) -> RequestOutput:
        if self.tokenizer is None:
            raise UserError("this model has no tokenizer, so it has no chat template")
        if not isinstance(messages, (list, tuple)):
            raise UserError(f"messages must be a list of {{'role': ..., 'content': ...}} mappings, got "
                            f"{type(messages).__name__}")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([self.tokenizer.encode(text, add_bos=False)], sampling_params)[0]

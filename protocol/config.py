"""What defines a training run: model shape, data, inner and outer optimizers, sync.

These dataclasses are the content of a run manifest, so they live in ``protocol``: every
peer of a run must agree on them bit for bit, and a manifest from a stranger is checked
against them field by field. ``peer`` implements what they describe.

Each class validates itself in ``__post_init__`` so a bad value fails at load time with a
one-line ``ConfigError`` naming the field, not an hour into a run.
``to_dict`` / ``from_dict`` convert to and from plain msgpack/TOML-friendly dicts and reject
unknown keys and wrong types.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field

from protocol.errors import ConfigError

# Names of the wire codecs; the implementations live in protocol.codecs.
CODEC_NAMES = ("fp32", "fp16", "bf16", "int8", "fp4")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP."""

    n_layers: int
    """Transformer blocks. Fragments are strided over these (layer i -> fragment i % P)."""
    d_model: int
    """Residual stream width."""
    n_heads: int
    """Attention heads; ``d_model`` must be divisible by it."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means ``n_heads`` (plain MHA)."""
    d_ff: int
    """Hidden width of the SwiGLU MLP (each of its three matrices is d_model x d_ff)."""
    vocab_size: int = 256
    """256 for byte-level tokens (the default); a tokenizer file sets its own size."""
    seq_len: int = 256
    """Context length in tokens, and the length of every training sequence."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head (saves vocab*d_model parameters)."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "d_ff", "vocab_size", "seq_len"):
            _check(getattr(self, name) >= 1, f"model.{name} must be >= 1, got {getattr(self, name)}")
        _check(self.d_model % self.n_heads == 0,
               f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        _check((self.d_model // self.n_heads) % 2 == 0,
               "model.d_model / model.n_heads must be even (rotary embeddings rotate pairs)")
        kv = self.kv_heads
        _check(1 <= kv <= self.n_heads and self.n_heads % kv == 0,
               f"model.n_kv_heads ({kv}) must divide model.n_heads ({self.n_heads})")
        _check(self.rope_theta > 0 and self.norm_eps > 0, "model.rope_theta and model.norm_eps must be > 0")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def num_params(self) -> int:
        """Exact parameter count of ``peer.model.Transformer`` built from this config."""
        d, f, L = self.d_model, self.d_ff, self.n_layers
        kv_dim = self.kv_heads * self.head_dim
        attn = d * d + 2 * d * kv_dim + d * d  # wq, wk, wv, wo
        mlp = 3 * d * f  # w_gate, w_up, w_down
        norms = 2 * d
        emb = self.vocab_size * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return emb + L * (attn + mlp + norms) + d + head


# Named model sizes. `tiny` runs CPU tests in seconds; `150m` is the DiLoCo paper's size;
# `1b` is the TinyLlama shape (22 layers, 2048 wide, GQA with 4 KV heads, d_ff 5632).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(n_layers=4, d_model=64, n_heads=4, d_ff=192, seq_len=128),
    "small": ModelConfig(n_layers=6, d_model=128, n_heads=4, d_ff=384, seq_len=256),
    "150m": ModelConfig(n_layers=12, d_model=1024, n_heads=16, d_ff=2816, seq_len=1024),
    "1b": ModelConfig(n_layers=22, d_model=2048, n_heads=32, n_kv_heads=4, d_ff=5632,
                      seq_len=2048, tie_embeddings=False),
}


def model_preset(name: str) -> ModelConfig:
    """Return the preset called ``name`` or raise a ConfigError listing the choices."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Where training text comes from and how it is split."""

    source: str = "stdlib"
    """``stdlib`` (the running Python's standard library .py files, for demos: it differs
    between Python versions and is not fingerprinted), a file, a folder, or a glob of text or
    ``.jsonl`` files (one document per line, its ``text_field``), or ``hf:NAME[:CONFIG]``: a
    Hugging Face dataset, streamed from the hub at the revision the fingerprint pins, or
    ``hf:FOLDER``, one saved with ``datasets``' ``save_to_disk`` (its ``train`` split)."""
    seed: int = 0
    """Seeds the held-out split and every worker's shard."""
    heldout_fraction: float = 0.02
    """Share of documents (chosen by a hash of their name and seed) that no worker trains on."""
    tokenizer: str | None = None
    """Path to a Hugging Face ``tokenizers`` JSON file; None means raw bytes (vocab 256)."""
    shards: int = 1
    """Training documents are dealt into this many shards by a hash of their name and seed,
    and each worker reads one, chosen by a hash of its identity and seed. 1: every worker
    samples from all of them."""
    max_shard_bytes: int = 0
    """Most bytes of text a worker reads from its shard (then it stops reading); 0: all of it.
    Bounds memory and download with a large or streamed dataset."""
    text_field: str = "text"
    """The field holding a document's text in ``.jsonl`` lines and ``hf:`` datasets."""
    fingerprint: str = ""
    """What ``run new`` found at ``source`` (``peer.sources.fingerprint``): a worker whose data
    differs refuses to start. Empty: not checked (``stdlib``)."""
    tokenizer_sha256: str = ""
    """SHA-256 of the tokenizer file, set by ``run new``; a worker with another file refuses
    to start."""

    def __post_init__(self) -> None:
        _check(bool(self.source), "data.source must not be empty; use 'stdlib' or a path")
        _check(len(self.source) <= 1024 and "\n" not in self.source, "data.source must be one line of at most 1024 characters")
        _check(0.0 < self.heldout_fraction < 0.5,
               f"data.heldout_fraction must be in (0, 0.5), got {self.heldout_fraction}")
        _check(self.seed >= 0, "data.seed must be >= 0")
        _check(1 <= self.shards <= 1 << 20, f"data.shards must be in [1, 1048576], got {self.shards}")
        _check(self.max_shard_bytes >= 0, f"data.max_shard_bytes must be >= 0 (0: no limit), got {self.max_shard_bytes}")
        _check(0 < len(self.text_field) <= 64, "data.text_field must be a field name of 1 to 64 characters")
        _check(len(self.fingerprint) <= 256 and "\n" not in self.fingerprint,
               "data.fingerprint must be one line of at most 256 characters")
        _check(self.tokenizer_sha256 == "" or (len(self.tokenizer_sha256) == 64
                                               and all(c in "0123456789abcdef" for c in self.tokenizer_sha256)),
               "data.tokenizer_sha256 must be empty or 64 lowercase hex digits")
        _check(not self.tokenizer_sha256 or self.tokenizer is not None,
               "data.tokenizer_sha256 is set but data.tokenizer is not")


@dataclass(frozen=True, kw_only=True, slots=True)
class InnerConfig:
    """The inner optimizer: AdamW with linear warmup then cosine decay."""

    lr: float = 3e-3
    """Peak learning rate. Lower it (e.g. 4e-4) for models above ~100M parameters."""
    min_lr_ratio: float = 0.1
    """The cosine decays to lr * min_lr_ratio at ``total_steps``."""
    warmup_steps: int = 50
    total_steps: int = 1000
    """Inner steps each worker plans to run; sets the cosine's length (steps beyond it stay at
    the minimum lr)."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    batch_size: int = 16
    """Sequences per micro-batch on one worker."""
    grad_accum: int = 1
    """Micro-batches per inner step; raise it instead of batch_size when memory is short."""

    def __post_init__(self) -> None:
        _check(self.lr > 0 and math.isfinite(self.lr), f"inner.lr must be > 0, got {self.lr}")
        _check(0 <= self.min_lr_ratio <= 1, "inner.min_lr_ratio must be in [0, 1]")
        _check(self.warmup_steps >= 0, "inner.warmup_steps must be >= 0")
        _check(self.total_steps >= 1, "inner.total_steps must be >= 1")
        _check(self.weight_decay >= 0, "inner.weight_decay must be >= 0")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "inner.beta1 and inner.beta2 must be in [0, 1)")
        _check(self.grad_clip >= 0, "inner.grad_clip must be >= 0 (0 disables)")
        _check(self.batch_size >= 1 and self.grad_accum >= 1, "inner.batch_size and inner.grad_accum must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class OuterConfig:
    """The outer optimizer: SGD with Nesterov momentum on the global copy (DiLoCo)."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        _check(self.lr > 0 and math.isfinite(self.lr), f"outer.lr must be > 0, got {self.lr}")
        _check(0 <= self.momentum < 1, f"outer.momentum must be in [0, 1), got {self.momentum}")
        _check(not (self.nesterov and self.momentum == 0),
               "outer.nesterov needs outer.momentum > 0; set nesterov = false for plain SGD")


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncConfig:
    """How workers communicate. One code path serves three methods:

    - Streaming DiLoCo: ``method="diloco"``, ``fragments`` > 1, ``overlap`` > 0, a 4-bit codec.
    - DiLoCo: ``method="diloco"``, ``fragments=1``, ``overlap=0``, ``alpha=0``.
    - Data-parallel: ``method="ddp"``: gradients averaged (fp32) every inner step, no outer
      optimizer. (Outer steps with H=1 would average AdamW *updates*, not gradients, which is
      not data-parallel; see docs/ARCHITECTURE.md.)
    """

    method: str = "diloco"
    """``diloco`` (outer steps on fragments) or ``ddp`` (gradient all-reduce every step)."""
    inner_steps: int = 50
    """H: inner steps between two syncs of the same fragment."""
    fragments: int = 1
    """P: number of fragments; layer i belongs to fragment i % P."""
    overlap: int = 0
    """tau: inner steps that run while a fragment's all-reduce is in flight. Must be < H/P so a
    fragment's result lands before its next sync starts."""
    alpha: float = 0.0
    """Merge weight: local = alpha*local + (1-alpha)*global after the outer step. 0 replaces the
    local copy (DiLoCo); 0.5 is robust for overlap up to ~5 (Streaming DiLoCo)."""
    late_share: float = 0.1
    """With overlap (tau >= 1): a node whose result is not there at s + tau trains on and lands
    it when it comes, up to this share of H after the sync started (and before the next
    fragment's start); past that it waits. Peers of one group reach a sync a few steps apart,
    and waiting for the last was most of the time a node was blocked; the cost is the quality
    of a larger overlap (``peer.sync_pipeline.late_allowance``). 0: always land at s + tau."""
    follow: bool = True
    """A node slower than the swarm follows its rounds (``peer.pace``): it starts each sync
    when the others of its group do, with the inner steps it managed, so nobody waits for it.
    False: lockstep, every node trains all H inner steps of every round and its groups wait for
    the slowest member (up to the all-reduce deadline), as DiLoCo on a fleet of equal machines
    does. Two lockstep runs of one setup train the same steps whatever the machines' load, so
    they compare step for step (the liar tests; on a shared machine following moved the
    tokens trained, and so the loss, by a few percent from run to run)."""
    codec: str = "fp32"
    """Wire format of pseudo-gradients: fp32, fp16, bf16, int8, fp4."""
    clip: float = 1.0
    """Robust averaging: each reducer scales a member's slice down to at most ``clip`` times
    the lower median of the slices' norms before taking the mean, so one member cannot push
    the average arbitrarily far, and gives a slice far beyond that (over ``25 x max(1, clip)``
    times the median, none at twice that) less weight, to none (``protocol.butterfly.clip_scale``;
    see docs/THREAT_MODEL.md). 0 takes the plain weighted mean. 1 (the default) lets a liar push
    at most an honest norm in a direction of its choosing: at 2 a constant direction at twice its
    norm cost +24% held-out loss in ``bench/quality.py``'s aimed-liar rows, at 1 +2%, while honest
    runs lose 0.3% (the members above the lower median are brought down to it)."""
    audit: float = 0.1
    """Chance that a member audits each other reducer's mean after a round: it fetches the
    mean's inputs, recomputes it, and bans a reducer whose mean does not follow from them
    (see docs/THREAT_MODEL.md). An audit costs the auditor about one part's pushes plus its
    reducer's slice in fp32. 0 turns audits off."""
    gate: bool = True
    """Direction gate, after the clip: the member's slice pointing furthest against the sum of
    the others' (a negative dot) counts for nothing in its part's mean, then the next against
    what is left, up to a third of the part's weight; the mean is over the weight kept
    (``protocol.gate``). The clip bounds how far one liar pushes, the gate where: one liar of
    four pushing against the others cost +0.3-0.5% held-out loss in ``bench/robust_mean.py``
    instead of the clip's +1.8-2.8%, with honest runs unchanged. It acts with a clip only
    (``clip`` 0 is the plain mean) and among three contributions or more (it does nothing in
    pairs). A run whose manifest was made before this field existed has it off
    (``protocol.manifest``)."""

    def __post_init__(self) -> None:
        _check(self.method in ("diloco", "ddp"), f"sync.method must be 'diloco' or 'ddp', got {self.method!r}")
        _check(self.inner_steps >= 1, f"sync.inner_steps (H) must be >= 1, got {self.inner_steps}")
        _check(self.fragments >= 1, f"sync.fragments (P) must be >= 1, got {self.fragments}")
        _check(self.fragments <= self.inner_steps,
               f"sync.fragments ({self.fragments}) must be <= sync.inner_steps ({self.inner_steps}) "
               "so every fragment gets its own sync step")
        _check(self.overlap >= 0, f"sync.overlap (tau) must be >= 0, got {self.overlap}")
        _check(self.overlap < max(1, self.inner_steps // self.fragments) or self.overlap == 0,
               f"sync.overlap (tau={self.overlap}) must be < H/P = {self.inner_steps // self.fragments} "
               "so a fragment's average lands before its next sync")
        _check(0.0 <= self.alpha < 1.0, f"sync.alpha must be in [0, 1), got {self.alpha}")
        _check(0.0 <= self.late_share <= 0.5, f"sync.late_share must be in [0, 0.5], got {self.late_share}")
        _check(self.clip == 0.0 or 1.0 <= self.clip <= 1e6,
               f"sync.clip must be 0 (plain mean) or in [1, 1e6], got {self.clip}")
        _check(0.0 <= self.audit <= 1.0, f"sync.audit must be in [0, 1], got {self.audit}")
        _check(self.codec in CODEC_NAMES, f"sync.codec must be one of {', '.join(CODEC_NAMES)}, got {self.codec!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Everything a worker needs to train its part of a run, and nothing about the network."""

    model: ModelConfig = field(default_factory=lambda: PRESETS["tiny"])
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)

    def tokens_per_step(self) -> int:
        """Tokens one inner step trains on: batch x accumulation x sequence length."""
        return self.inner.batch_size * self.inner.grad_accum * self.model.seq_len

    def max_sync_tokens(self) -> int:
        """The most tokens one fragment's sync may cover: H inner steps of batch x accumulation
        x sequence length. A member declaring more weight is refused (peer.matchmaking)."""
        return self.sync.inner_steps * self.tokens_per_step()

    def __post_init__(self) -> None:
        _check(self.sync.fragments <= self.model.n_layers,
               f"sync.fragments ({self.sync.fragments}) must be <= model.n_layers "
               f"({self.model.n_layers}); every fragment needs at least one layer")


# ---------------------------------------------------------------------------------------
# Plain-dict conversion (msgpack, TOML). Strict: unknown keys and wrong types are errors.


def to_dict(cfg: typing.Any) -> dict[str, typing.Any]:
    """A dataclass config as nested plain dicts (``None`` fields kept, so the key set is fixed)."""
    out: dict[str, typing.Any] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = to_dict(v) if dataclasses.is_dataclass(v) else v
    return out


def _coerce(tp: typing.Any, value: typing.Any, where: str) -> typing.Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            _check(type(None) in args, f"{where} must not be null")
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, where)
    if dataclasses.is_dataclass(tp):
        _check(isinstance(value, dict), f"{where} must be a table/map, got {type(value).__name__}")
        return from_dict(tp, value, where)
    if tp is bool:
        _check(isinstance(value, bool), f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), f"{where} must be a number, got {value!r}")
        _check(math.isfinite(value), f"{where} must be finite, got {value!r}")
        return float(value)
    if tp is str:
        _check(isinstance(value, str), f"{where} must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config field type {tp!r} at {where}")  # a bug in this module


def from_dict(cls: type, data: typing.Mapping[str, typing.Any], where: str = "") -> typing.Any:
    """Build ``cls`` from a plain dict, validating keys, types and values (raises ConfigError)."""
    _check(isinstance(data, typing.Mapping), f"{where or cls.__name__} must be a map")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, data)) - names)
    _check(not unknown, f"unknown key(s) {', '.join(repr(k) for k in unknown)} in {where or cls.__name__}; "
                        f"allowed: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in data.items():
        path = f"{where}.{name}" if where else name
        kwargs[name] = _coerce(hints[name], value, path)
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{where or cls.__name__}: {e}") from None


# The three methods the engine runs, as sync settings (flags override fields). Streaming uses
# P=2 because the `tiny` preset has 4 layers; the paper's rule of thumb is ~3 layers a fragment.
SYNC_MODES: dict[str, SyncConfig] = {
    "ddp": SyncConfig(method="ddp"),
    "diloco": SyncConfig(method="diloco", inner_steps=50, fragments=1, overlap=0, alpha=0.0, codec="fp32"),
    "streaming": SyncConfig(method="diloco", inner_steps=50, fragments=2, overlap=1, alpha=0.5, codec="fp4"),
}

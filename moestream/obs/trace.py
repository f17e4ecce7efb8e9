"""Router traces: record every MoE layer's top-k ids and gate weights while generating, save them
in a documented folder format, and load them back.

Format (a folder, see docs/obs.md):
  trace.json    header: format/version, model facts (experts, top-k, MoE layer ids, expert size),
                sampling settings, and one record per sequence (row offset, length, prompt length,
                prompt text, generated ids, finish reason)
  ids.npy       int16   [N, L, K]  top-k expert ids per position and MoE layer, in router order
  weights.npy   float32 [N, L, K]  the matching gate weights (after the model's renormalisation)
  tokens.npy    int32   [N]        the input token at each position
  hidden.npy    float16 [N, L, D]  the router's input hidden state (only with --hidden)
N counts positions over all sequences, concatenated; L counts MoE layers only. Row r of a sequence
is a prompt position when r < prompt_tokens, else a generated one. The last sampled token of a
sequence is never fed back through the model, so it has no row.

Recording never synchronises per layer: the observer copies into preallocated per-step buffers on
the model's device, and the step is moved to the host once, after the last MoE layer, then appended
to the .npy files on disk (their headers are rewritten with the final row count on close).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from moestream.config import ConfigError

FORMAT = "moestream-trace"
VERSION = 1
_NPY_HEADER_BYTES = 128  # fixed, so the header can be rewritten in place once N is known


class TraceError(ConfigError):
    """A trace folder that is missing, malformed or of another format version."""


# ---------------------------------------------------------------------------------------------
# Writing


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    d = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    body = repr(d).encode("latin1")
    pad = _NPY_HEADER_BYTES - 10 - len(body) - 1
    assert pad >= 0, f"npy header for shape {shape} does not fit in {_NPY_HEADER_BYTES} bytes"
    body = body + b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body


class NpyAppender:
    """A .npy file that grows by rows; valid for np.load once closed."""

    def __init__(self, path: Path, dtype, row_shape: tuple[int, ...]):
        self.path, self.dtype, self.row_shape = path, np.dtype(dtype), tuple(row_shape)
        self.rows = 0
        self.f = open(path, "wb")
        self.f.write(_npy_header(self.dtype, (0, *self.row_shape)))

    def append(self, a: np.ndarray) -> None:
        assert a.shape[1:] == self.row_shape, (
            f"{self.path.name}: rows {a.shape[1:]} != {self.row_shape}"
        )
        self.f.write(np.ascontiguousarray(a, dtype=self.dtype).tobytes())
        self.rows += a.shape[0]

    def close(self, rows: int | None = None) -> None:
        """Write the final header; `rows` drops any rows after it (an interrupted sequence)."""
        self.rows = self.rows if rows is None else min(rows, self.rows)
        row_bytes = self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))
        self.f.truncate(_NPY_HEADER_BYTES + self.rows * row_bytes)
        self.f.seek(0)
        self.f.write(_npy_header(self.dtype, (self.rows, *self.row_shape)))
        self.f.close()


@dataclass
class TraceModel:
    """The model facts a trace needs to be read without the model."""

    model_type: str
    num_experts: int
    top_k: int
    moe_layers: list[int]  # model layer index of each trace column
    hidden_size: int
    num_hidden_layers: int
    expert_params: int  # parameters of one routed expert (gate + up + down)
    dtype: str
    expert_bytes: int = 0  # bytes one expert occupies where it was read from (0 = unknown)
    # Per trace column, the bytes a read of one record there costs (a store's per-layer record
    # layouts); empty: expert_bytes everywhere.
    record_bytes: list[int] = field(default_factory=list)

    @classmethod
    def from_args(cls, args, dtype: str, expert_bytes: int, record_bytes=()) -> TraceModel:
        return cls(
            model_type=args.model_type,
            num_experts=args.num_experts,
            top_k=args.num_experts_per_tok,
            moe_layers=list(args.moe_layer_ids),
            hidden_size=args.hidden_size,
            num_hidden_layers=args.num_hidden_layers,
            expert_params=3 * args.hidden_size * args.moe_intermediate_size,
            dtype=dtype,
            expert_bytes=expert_bytes,
            record_bytes=list(record_bytes),
        )

    def layer_bytes(self) -> dict[int, int] | None:
        """MoE layer -> the bytes one record read there costs (None: expert_bytes for each)."""
        return dict(zip(self.moe_layers, self.record_bytes)) if self.record_bytes else None


TRACE_FILES = ("trace.json", "ids.npy", "weights.npy", "tokens.npy", "hidden.npy")


def prepare_out(folder: str | Path, force: bool = False) -> Path:
    """The folder a new trace goes to. An existing one is refused unless `force`; then the old
    trace's files are removed first, so none (e.g. hidden.npy) is left beside the new trace."""
    folder = Path(folder)
    if not folder.exists():
        return folder
    if not force:
        raise TraceError(
            f"{folder} already exists; pass --force to replace it, or choose another -o"
        )
    if not folder.is_dir():
        raise TraceError(f"{folder} is a file; -o names the trace folder to write")
    others = sorted(p.name for p in folder.iterdir() if p.name not in TRACE_FILES)
    if others:
        # --force replaces a trace; it never deletes a folder of other things.
        raise TraceError(
            f"{folder} is not a trace folder (it holds {', '.join(others[:3])}); choose another -o"
        )
    for name in TRACE_FILES:
        (folder / name).unlink(missing_ok=True)
    return folder


class TraceWriter:
    """Appends steps of routing rows; `end_sequence` closes one prompt's record."""

    def __init__(
        self, folder: str | Path, model: TraceModel, hidden: bool, extra: dict | None = None
    ):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.model, self.hidden, self.extra = model, hidden, extra or {}
        L, K = len(model.moe_layers), model.top_k
        self.ids = NpyAppender(self.folder / "ids.npy", np.int16, (L, K))
        self.weights = NpyAppender(self.folder / "weights.npy", np.float32, (L, K))
        self.tokens = NpyAppender(self.folder / "tokens.npy", np.int32, ())
        self.hid = (
            NpyAppender(self.folder / "hidden.npy", np.float16, (L, model.hidden_size))
            if hidden
            else None
        )
        self.sequences: list[dict] = []
        self.seq_start = 0

    def append_step(self, ids: np.ndarray, weights: np.ndarray, hidden: np.ndarray | None) -> None:
        """ids/weights [T, L, K], hidden [T, L, D] for the T positions of one forward step."""
        self.ids.append(ids)
        self.weights.append(weights)
        if self.hid is not None:
            assert hidden is not None, "trace records hidden states but the step has none"
            self.hid.append(hidden)

    def end_sequence(self, tokens: list[int], prompt_tokens: int, **meta) -> None:
        n = self.ids.rows - self.seq_start
        if n != len(tokens):
            raise TraceError(
                f"recorded {n} positions but the sequence fed {len(tokens)} tokens; an observer "
                "call was missed (is another observer installed?)"
            )
        self.tokens.append(np.asarray(tokens, dtype=np.int32))
        self.sequences.append(
            {"offset": self.seq_start, "length": n, "prompt_tokens": prompt_tokens, **meta}
        )
        self.seq_start = self.ids.rows

    def close(self) -> None:
        """Finish the files; rows of a sequence that did not end (an error, the memory guard) are
        dropped so the trace holds complete sequences only."""
        for a in (self.ids, self.weights, self.tokens, self.hid):
            if a is not None:
                a.close(self.seq_start)
        header = {
            "format": FORMAT,
            "version": VERSION,
            # record_bytes only where records differ in size: every other trace stays as before
            "model": {k: v for k, v in self.model.__dict__.items() if v or k != "record_bytes"},
            "hidden": self.hidden,
            "hidden_dtype": "float16" if self.hidden else None,
            "positions": self.seq_start,
            "sequences": self.sequences,
            **self.extra,
        }
        (self.folder / "trace.json").write_text(json.dumps(header, indent=1))


# ---------------------------------------------------------------------------------------------
# Recording


class TraceRecorder:
    """The MoE observer: copies each layer's routing into per-step device buffers (no sync) and
    hands the whole step to `sink(ids, weights, hidden)` as numpy after the last MoE layer."""

    def __init__(self, moe_layers: list[int], top_k: int, hidden_size: int, hidden: bool, sink):
        self.col = {layer: i for i, layer in enumerate(moe_layers)}
        self.L, self.K, self.D = len(moe_layers), top_k, hidden_size
        self.record_hidden, self.sink = hidden, sink
        self.cap = 0
        self.T = 0

    def _alloc(self, T: int, device: torch.device) -> None:
        cap = max(T, 1)
        self.ids = torch.empty(cap, self.L, self.K, dtype=torch.int16, device=device)
        self.w = torch.empty(cap, self.L, self.K, dtype=torch.float32, device=device)
        self.h = (
            torch.empty(cap, self.L, self.D, dtype=torch.float16, device=device)
            if self.record_hidden
            else None
        )
        self.cap = cap

    def __call__(self, layer: int, ids: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> None:
        col = self.col[layer]
        T = ids.shape[0]
        if col == 0:
            self.T = T
            if T > self.cap or self.ids.device != ids.device:
                self._alloc(T, ids.device)
        self.ids[:T, col].copy_(ids)  # device-side copies: no host sync here
        self.w[:T, col].copy_(w)
        if self.h is not None:
            self.h[:T, col].copy_(x)
        if col == self.L - 1:
            self._flush()

    def _flush(self) -> None:
        T = self.T
        h = self.h[:T].cpu().numpy() if self.h is not None else None
        self.sink(self.ids[:T].cpu().numpy(), self.w[:T].cpu().numpy(), h)
        self.T = 0


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line; a line that is a JSON object with a "prompt" field is read as JSONL.
    Blank lines are skipped."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompts file {p} does not exist")
    prompts = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                obj = None
            if isinstance(obj, dict):
                if "prompt" not in obj:
                    raise TraceError(f"{p}:{n}: JSON line without a 'prompt' field")
                prompts.append(str(obj["prompt"]))
                continue
        prompts.append(line)
    if not prompts:
        raise TraceError(f"{p} has no prompts (one per line, or JSONL with a 'prompt' field)")
    return prompts


def expert_bytes(rt, dtype: str) -> int:
    """Bytes of one expert as the provider holds it: a store's record slot (the largest record,
    what a budget is divided by: `slot_count`), else the weights at the compute dtype (resident
    Hugging Face load)."""
    if rt.store is not None:
        return int(rt.store.slot_size)
    a = rt.args
    itemsize = rt.model.dtype.itemsize  # experts load in the model dtype
    return 3 * a.hidden_size * a.moe_intermediate_size * itemsize


def record_trace(
    rt,
    prompts: list[str],
    cfg,
    out: str | Path,
    *,
    hidden: bool = False,
    chat: bool = False,
    dtype: str = "float32",
    on_sequence=None,
) -> Path:
    """Generate for each prompt with `rt.generator` (a Runtime) and write the trace folder `out`.
    `on_sequence(i, result)` is called after each prompt (progress output)."""
    if cfg.max_new_tokens < 1:
        raise ConfigError("a trace needs at least one generated token (-n >= 1)")
    model = rt.model
    sizes = [rt.store.layouts[i].size for i in rt.args.moe_layer_ids] if rt.store else []
    sizes = sizes if len(set(sizes)) > 1 else []
    info = TraceModel.from_args(rt.args, dtype, expert_bytes(rt, dtype), sizes)
    sampling = dataclasses.asdict(cfg)
    writer = TraceWriter(out, info, hidden, extra={"sampling": sampling, "chat": chat})
    rec = TraceRecorder(info.moe_layers, info.top_k, info.hidden_size, hidden, writer.append_step)
    model.set_observer(rec)
    try:
        for i, prompt in enumerate(prompts):
            ids = rt.encode_prompt(prompt, chat=chat)
            res = rt.generator.generate(ids, cfg)
            fed = list(ids) + res.ids[:-1]  # the last sampled token never runs through the model
            writer.end_sequence(
                fed,
                len(ids),
                prompt=prompt,
                generated_ids=res.ids,
                finish_reason=res.finish_reason,
                text=res.text,
            )
            if on_sequence is not None:
                on_sequence(i, res)
    finally:
        model.set_observer(None)
        writer.close()
    return Path(out)


# ---------------------------------------------------------------------------------------------
# Loading


@dataclass
class Trace:
    """A loaded trace. Arrays are memory-mapped when loaded from disk."""

    model: TraceModel
    ids: np.ndarray  # [N, L, K] int16
    weights: np.ndarray  # [N, L, K] float32
    tokens: np.ndarray  # [N] int32
    sequences: list[dict]
    hidden: np.ndarray | None = None  # [N, L, D] float16
    header: dict = field(default_factory=dict)

    @property
    def num_experts(self) -> int:
        return self.model.num_experts

    @property
    def top_k(self) -> int:
        return self.model.top_k

    @property
    def n_layers(self) -> int:
        return self.ids.shape[1]

    @property
    def n_positions(self) -> int:
        return self.ids.shape[0]

    def sequence_slices(self) -> list[slice]:
        return [slice(s["offset"], s["offset"] + s["length"]) for s in self.sequences]

    @property
    def is_prompt(self) -> np.ndarray:
        """[N] bool: True at prompt positions, False at generated ones."""
        m = np.zeros(self.n_positions, dtype=bool)
        for s in self.sequences:
            m[s["offset"] : s["offset"] + s["prompt_tokens"]] = True
        return m

    @classmethod
    def from_ids(
        cls,
        ids,
        num_experts: int,
        prompt_tokens: list[int] | None = None,
        lengths: list[int] | None = None,
        weights=None,
    ) -> Trace:
        """An in-memory trace from ids [N, L, K] (hand-made traces, tests). `lengths` splits the
        rows into sequences (default: one); `prompt_tokens` gives each one's prompt length."""
        ids = np.asarray(ids, dtype=np.int16)
        N, L, K = ids.shape
        lengths = lengths or [N]
        prompt_tokens = prompt_tokens or [1] * len(lengths)
        assert sum(lengths) == N, f"sequence lengths {lengths} do not add up to {N} rows"
        offsets = np.cumsum([0, *lengths[:-1]]).tolist()
        seqs = [
            {"offset": o, "length": n, "prompt_tokens": p}
            for o, n, p in zip(offsets, lengths, prompt_tokens)
        ]
        model = TraceModel("hand-made", num_experts, K, list(range(L)), 0, L, 0, "float32")
        w = np.full(ids.shape, 1.0 / K, np.float32) if weights is None else np.asarray(weights)
        return cls(model, ids, w, np.zeros(N, np.int32), seqs)


def load_trace(path: str | Path, mmap: bool = True) -> Trace:
    """Load a trace folder written by `moestream trace` (arrays memory-mapped unless mmap=False)."""
    folder = Path(path)
    head_path = folder / "trace.json"
    if not head_path.is_file():
        raise TraceError(
            f"{folder} is not a trace folder (no trace.json); make one with `moestream trace`"
        )
    header = json.loads(head_path.read_text())
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise TraceError(
            f"{head_path}: format {header.get('format')!r} v{header.get('version')} is not "
            f"{FORMAT} v{VERSION}; re-record it with this moestream"
        )
    mode = "r" if mmap else None

    def arr(name: str) -> np.ndarray:
        p = folder / name
        if not p.is_file():
            raise TraceError(f"{p} is missing; the trace folder is incomplete")
        return np.load(p, mmap_mode=mode)

    model = TraceModel(**header["model"])
    t = Trace(
        model=model,
        ids=arr("ids.npy"),
        weights=arr("weights.npy"),
        tokens=arr("tokens.npy"),
        sequences=header["sequences"],
        hidden=arr("hidden.npy") if header.get("hidden") else None,
        header=header,
    )
    N = header["positions"]
    if t.ids.shape != (N, len(model.moe_layers), model.top_k) or t.tokens.shape != (N,):
        raise TraceError(
            f"{folder}: arrays ({t.ids.shape}, {t.tokens.shape}) disagree with the header "
            f"({N} positions, {len(model.moe_layers)} MoE layers, top-{model.top_k})"
        )
    return t

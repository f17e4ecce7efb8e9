"""Training loop for the reference MoE model: transformers' `Qwen3MoeForCausalLM`, trained on packed
windows of a token stream with cross-entropy plus the load-balancing auxiliary loss.

The model is HF's own class, so what is saved is exactly the `qwen3_moe` architecture. Speed comes
from bf16 autocast, fused AdamW, a grouped-GEMM experts forward (HF's `grouped_mm`, or the local
`grouped_bf16` variant that runs the grouped GEMMs in bf16 from the fp32 master weights) and,
optionally, torch.compile.

Checkpoints are folders: `weights-NNNNN.safetensors` shards (each below --shard-mib), `state.json`
(step, tokens seen, spec, run arguments) and, unless left out, `optimizer.pt`. A resume without
optimizer state re-warms the learning rate over --rewarm-steps steps.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import time
import types
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class ModelSpec:
    vocab_size: int = 8192
    hidden_size: int = 256
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    num_experts: int = 64
    top_k: int = 8
    moe_intermediate_size: int = 64
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    router_aux_loss_coef: float = 0.01
    tie_word_embeddings: bool = True
    eot_id: int = 0


def make_config(spec: ModelSpec):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=4 * spec.hidden_size,  # dense MLP size; unused (every layer is MoE)
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        hidden_act="silu",
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tie_word_embeddings,
        attention_bias=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k,
        moe_intermediate_size=spec.moe_intermediate_size,
        norm_topk_prob=True,
        output_router_logits=False,
        router_aux_loss_coef=spec.router_aux_loss_coef,
        bos_token_id=spec.eot_id,
        eos_token_id=spec.eot_id,
        pad_token_id=spec.eot_id,
        use_cache=True,
    )


def make_model(spec: ModelSpec, seed: int = 0):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = make_config(spec)
    model = Qwen3MoeForCausalLM(cfg)
    return model


# ---------------------------------------------------------------------------------------------
# experts forward: grouped GEMMs in bf16 (same math as HF's eager forward, other kernel)


def _grouped_bf16_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Tokens sorted by expert, two grouped GEMMs (gate_up, down) over all experts' weights cast
    to the autocast dtype, routing weights applied, slots summed back per token."""
    T, K = top_k_index.shape
    E = self.num_experts
    dtype = (
        torch.get_autocast_dtype("cuda")
        if torch.is_autocast_enabled("cuda")
        else hidden_states.dtype
    )
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.histc(flat.int() if flat.is_cuda else flat.float(), bins=E, min=0, max=E - 1)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = hidden_states[order // K].to(dtype)
    gu = torch._grouped_mm(x, self.gate_up_proj.to(dtype).transpose(1, 2), offs=offs)
    gate, up = gu.chunk(2, dim=-1)
    h = self.act_fn(gate) * up
    y = torch._grouped_mm(h, self.down_proj.to(dtype).transpose(1, 2), offs=offs)
    y = y.float() * top_k_weights.reshape(-1)[order].float().unsqueeze(-1)
    out = torch.empty_like(y).index_copy(0, order, y)
    return out.view(T, K, -1).sum(dim=1).to(hidden_states.dtype)


def set_experts_impl(model, impl: str) -> str:
    """impl: 'grouped_bf16' (local, CUDA only) or any of HF's experts implementations."""
    if impl == "grouped_bf16":
        if not torch.cuda.is_available():
            impl = "grouped_mm"
        else:
            for m in model.modules():
                if type(m).__name__.endswith("MoeExperts"):
                    m.forward = types.MethodType(_grouped_bf16_experts_forward, m)
            return impl
    model.set_experts_implementation(impl)
    return impl


# ---------------------------------------------------------------------------------------------
# data


class TokenStream:
    """A uint16 token stream held as int64 on the device; random packed windows per step."""

    def __init__(self, path_or_array, device, seed: int = 0):
        arr = (
            np.load(path_or_array) if isinstance(path_or_array, str) else np.asarray(path_or_array)
        )
        self.tokens = torch.from_numpy(arr.astype(np.int64)).to(device)
        self.device = device
        self.seed = seed

    def __len__(self):
        return self.tokens.numel()

    def batch(self, step: int, micro: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """Windows of seq_len+1 tokens; the draw depends only on (seed, step, micro), so a resumed
        run sees the same data as an uninterrupted one."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + micro)
        starts = torch.randint(0, len(self) - seq_len - 1, (batch_size,), generator=g)
        idx = starts.to(self.device)[:, None] + torch.arange(seq_len + 1, device=self.device)
        return self.tokens[idx]

    def eval_windows(self, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
        n = (len(self) - 1) // seq_len
        if max_windows:
            n = min(n, max_windows)
        return self.tokens[: n * seq_len + 1]


# ---------------------------------------------------------------------------------------------
# training


@dataclass
class TrainArgs:
    data: str = "data/tok"
    out: str = "runs/pystd"
    steps: int = 1000
    batch_size: int = 32  # sequences per micro-batch
    grad_accum: int = 1
    seq_len: int = 1024
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    rewarm_steps: int = 50
    weight_decay: float = 0.1
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200
    eval_windows: int = 64
    save_every: int = 0
    time_budget_s: float = 0.0  # stop (and save) after this many seconds; 0: no limit
    experts_impl: str = "grouped_bf16"
    compile: bool = False
    save_optimizer: bool = True
    ckpt_dtype: str = "float32"
    shard_mib: float = 15.0
    resume: str = ""
    device: str = ""
    spec: dict = field(default_factory=dict)


def lr_at(step: int, a: TrainArgs, rewarm_from: int | None = None) -> float:
    """Linear warmup then cosine decay to min_lr_ratio*lr over a.steps; after a resume without
    optimizer state, a linear re-warmup from rewarm_from."""
    if step < a.warmup:
        f = (step + 1) / a.warmup
    else:
        p = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
        f = a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    if rewarm_from is not None and step < rewarm_from + a.rewarm_steps:
        f *= (step - rewarm_from + 1) / a.rewarm_steps
    return a.lr * f


class Trainer:
    def __init__(self, spec: ModelSpec, args: TrainArgs, train_tokens=None, valid_tokens=None):
        self.spec = spec
        self.args = args
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.model = make_model(spec, seed=args.seed).to(self.device)
        self.model.config.use_cache = False
        self.experts_impl = set_experts_impl(self.model, args.experts_impl)
        self.model.train()
        decay, no_decay = [], []
        for n, p in self.model.named_parameters():
            (decay if p.ndim >= 2 and "embed" not in n else no_decay).append(p)
        self.opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": args.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=args.lr,
            betas=(0.9, args.beta2),
            eps=1e-8,
            fused=self.device.type == "cuda",
        )
        self.step = 0
        self.tokens_seen = 0
        self.rewarm_from: int | None = None
        self.train = (
            TokenStream(train_tokens, self.device, args.seed) if train_tokens is not None else None
        )
        self.valid = TokenStream(valid_tokens, self.device) if valid_tokens is not None else None
        self._fwd = self._loss
        if args.compile:
            self._fwd = torch.compile(self._loss)

    # -- core -----------------------------------------------------------------------------------
    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    def _loss(self, window: torch.Tensor):
        """Cross-entropy of next tokens plus coef * load-balancing loss (HF's own aux loss)."""
        out = self.model(input_ids=window[:, :-1], output_router_logits=True, use_cache=False)
        logits = out.logits.float()
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), window[:, 1:].reshape(-1))
        aux = out.aux_loss
        return ce + self.model.config.router_aux_loss_coef * aux, ce, aux

    def train_step(self, windows: list[torch.Tensor]) -> dict:
        """One optimizer step over the micro-batches in `windows`."""
        a = self.args
        lr = lr_at(self.step, a, self.rewarm_from)
        for g in self.opt.param_groups:
            g["lr"] = lr
        ce_sum = aux_sum = 0.0
        for w in windows:
            with self._autocast():
                loss, ce, aux = self._fwd(w)
            (loss / len(windows)).backward()
            ce_sum += ce.detach()
            aux_sum += aux.detach()
            self.tokens_seen += w[:, 1:].numel()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        n = len(windows)
        return {"step": self.step, "lr": lr, "ce": ce_sum / n, "aux": aux_sum / n, "gnorm": gnorm}

    @torch.no_grad()
    def evaluate(self, max_windows: int | None = None, batch: int = 16) -> float:
        """Mean next-token cross-entropy over non-overlapping validation windows."""
        seq = self.args.seq_len
        toks = self.valid.eval_windows(seq, max_windows)
        n = (toks.numel() - 1) // seq
        self.model.eval()
        total, count = 0.0, 0
        for i in range(0, n, batch):
            j = min(n, i + batch)
            x = torch.stack([toks[k * seq : (k + 1) * seq + 1] for k in range(i, j)])
            with self._autocast():
                logits = self.model(input_ids=x[:, :-1], use_cache=False).logits.float()
            total += F.cross_entropy(
                logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum"
            ).item()
            count += x[:, 1:].numel()
        self.model.train()
        return total / max(1, count)

    # -- checkpoints ----------------------------------------------------------------------------
    def _weights(self) -> dict[str, torch.Tensor]:
        sd = self.model.state_dict()
        if self.model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        dt = getattr(torch, self.args.ckpt_dtype)
        return {k: v.detach().to("cpu", dt).contiguous() for k, v in sd.items()}

    def save(self, path: str, save_optimizer: bool | None = None) -> None:
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        for f in glob.glob(os.path.join(path, "weights-*.safetensors")):
            os.remove(f)
        limit = int(self.args.shard_mib * 2**20)
        shard, size, k = {}, 0, 0
        for name, t in self._weights().items():
            nb = t.numel() * t.element_size()
            if shard and size + nb > limit:
                save_file(shard, os.path.join(path, f"weights-{k:05d}.safetensors"))
                shard, size, k = {}, 0, k + 1
            shard[name] = t
            size += nb
        if shard:
            save_file(shard, os.path.join(path, f"weights-{k:05d}.safetensors"))
        save_optimizer = self.args.save_optimizer if save_optimizer is None else save_optimizer
        opt_path = os.path.join(path, "optimizer.pt")
        if save_optimizer:
            torch.save(self.opt.state_dict(), opt_path)
        elif os.path.exists(opt_path):
            os.remove(opt_path)
        state = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "rewarm_from": self.rewarm_from,
            "spec": dataclasses.asdict(self.spec),
            "args": dataclasses.asdict(self.args),
        }
        with open(os.path.join(path, "state.json"), "w") as f:
            json.dump(state, f, indent=1)

    def load(self, path: str) -> bool:
        """Restore weights, step, tokens seen and (if saved) optimizer state. Returns whether the
        optimizer state was restored; if not, the learning rate re-warms from this step."""
        from safetensors.torch import load_file

        sd = {}
        for f in sorted(glob.glob(os.path.join(path, "weights-*.safetensors"))):
            sd.update(load_file(f))
        missing, unexpected = self.model.load_state_dict(sd, strict=False)
        missing = [
            m
            for m in missing
            if not (m == "lm_head.weight" and self.model.config.tie_word_embeddings)
        ]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")
        with open(os.path.join(path, "state.json")) as f:
            state = json.load(f)
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.rewarm_from = state.get("rewarm_from")
        opt_path = os.path.join(path, "optimizer.pt")
        if os.path.exists(opt_path):
            self.opt.load_state_dict(
                torch.load(opt_path, map_location=self.device, weights_only=True)
            )
            return True
        self.rewarm_from = self.step
        return False

    # -- loop -----------------------------------------------------------------------------------
    def fit(self) -> None:
        a = self.args
        os.makedirs(a.out, exist_ok=True)
        log = open(os.path.join(a.out, "log.jsonl"), "a")
        t0 = time.time()
        last_t, last_tok = t0, self.tokens_seen

        def emit(rec):
            rec = {k: (float(v) if torch.is_tensor(v) else v) for k, v in rec.items()}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(json.dumps(rec), flush=True)

        while self.step < a.steps:
            windows = [
                self.train.batch(self.step, m, a.batch_size, a.seq_len) for m in range(a.grad_accum)
            ]
            m = self.train_step(windows)
            if self.step % a.log_every == 0 or self.step == a.steps:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                now = time.time()
                m.update(
                    tokens=self.tokens_seen,
                    elapsed=round(now - t0, 2),
                    tok_s=round((self.tokens_seen - last_tok) / max(1e-9, now - last_t)),
                )
                last_t, last_tok = now, self.tokens_seen
                emit(m)
            if (
                self.valid is not None
                and a.eval_every
                and (self.step % a.eval_every == 0 or self.step == a.steps)
            ):
                vl = self.evaluate(a.eval_windows)
                emit(
                    {
                        "step": self.step,
                        "tokens": self.tokens_seen,
                        "val_ce": vl,
                        "val_ppl": math.exp(vl),
                    }
                )
            if a.save_every and self.step % a.save_every == 0:
                self.save(os.path.join(a.out, "ckpt"))
            if a.time_budget_s and time.time() - t0 > a.time_budget_s:
                print(f"time budget reached at step {self.step}", flush=True)
                break
        self.save(os.path.join(a.out, "ckpt"))
        log.close()


# ---------------------------------------------------------------------------------------------
# export


def export_hf(ckpt: str, out_dir: str, tokenizer_dir: str, max_shard_size: str = "1GB") -> None:
    """Write an ordinary HF folder (bf16 model.safetensors, config, generation config, tokenizer)
    from a trainer checkpoint folder."""
    import shutil

    from safetensors.torch import load_file
    from transformers import GenerationConfig

    with open(os.path.join(ckpt, "state.json")) as f:
        state = json.load(f)
    spec = ModelSpec(**state["spec"])
    model = make_model(spec)
    sd = {}
    for f in sorted(glob.glob(os.path.join(ckpt, "weights-*.safetensors"))):
        sd.update(load_file(f))
    model.load_state_dict(sd, strict=False)
    model.tie_weights()
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.config.use_cache = True
    model.generation_config = GenerationConfig(
        bos_token_id=spec.eot_id,
        eos_token_id=spec.eot_id,
        pad_token_id=spec.eot_id,
        do_sample=False,
        max_new_tokens=256,
    )
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    # transformers 5 writes `num_local_experts`; published qwen3_moe configs (and older transformers)
    # use `num_experts`, which transformers 5 maps back on load.
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = os.path.join(tokenizer_dir, name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(out_dir, name))

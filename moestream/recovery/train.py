"""Training the recovery adapter on the student path (Edge0 stages 2 and 3); the base model, the
routers, the prerouter heads and the experts stay frozen, only the LoRA A/B matrices learn.

Stage 2 (`distill_step`): windows of the reference corpus run through the student path
(`StudentPath`: routing forced through the prerouter, as decode runs it) and the adapter learns
the fp32 teacher's (exact routing) next-token distribution at every position: target "teacher"
= KL(teacher || student) (cross-entropy to the teacher's softmax less its entropy), or "text" =
plain SFT on the corpus tokens. Teacher targets on corpus text, rather than sampled teacher text: greedy
continuations of this model loop (models/pystd-moe-29m/README.md), sampling one token per
position on the CPU costs a forward per token, and the full distribution is a denser signal
than one sampled token (it is the expectation of SFT on the teacher's samples).

Stage 3 (`on_policy_step`): the student (predicted routing + adapter) samples a continuation of
a corpus prompt token by token; teacher and student score it in one pass each, and the adapter
minimises the reverse KL(student || teacher) over the student's top-k tokens plus one bin for
the rest of the vocabulary (the tail-aware top-k objective: the tail's mass is kept, not
dropped), on the generated positions.

Devices (`student_on`, `teacher_on`, `deterministic`): the same code on the CPU or a GPU. The
student opens on the CPU with the dequantizing `ref` kernels (differentiable in the activations:
the adapters upstream of a layer learn through its frozen experts); on a GPU its model moves
there and its experts, dequantized once, run as `BatchedExperts` (experts/batched.py: a layer in
a few GEMMs; the per-expert loop is launch-bound there), as do the fp32 teacher's; a GPU run uses
torch's deterministic algorithms, so a seed gives the same adapter on the same device.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moestream.config import ConfigError
from moestream.engine.kv_cache import KVCache
from moestream.experts.config import StreamConfig

TARGETS = ("teacher", "text")
# the student's experts as it opens: resident, on the dequantizing ref kernels (differentiable)
STUDENT_EXPERTS = StreamConfig(resident=True, kernel="ref")


@dataclass(frozen=True, slots=True)
class RecoveryConfig:
    rank: int = 8
    alpha: float = 16.0
    steps: int = 200  # stage 2 steps
    batch: int = 2  # windows per step (gradients accumulated)
    ctx: int = 256  # tokens per window
    lr: float = 2e-3  # peak, cosine to lr/10 after 5% warm-up
    target: str = "teacher"
    on_policy_steps: int = 0  # stage 3 steps after stage 2
    gen_tokens: int = 32  # stage 3: tokens the student samples per prompt
    prompt_tokens: int = 32  # stage 3: corpus tokens before them
    top_k: int = 16  # stage 3: tokens of the student's top-k scored exactly (+ one tail bin)
    seed: int = 0

    def __post_init__(self):
        for name in ("rank", "batch", "gen_tokens", "prompt_tokens", "top_k"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if self.steps < 0 or self.on_policy_steps < 0 or self.steps + self.on_policy_steps == 0:
            raise ConfigError("--steps and --on-policy-steps must be >= 0 and not both 0")
        if self.ctx < 2:
            raise ConfigError(f"--ctx {self.ctx}: a window needs at least 2 tokens")
        if not (self.lr > 0 and self.alpha > 0):
            raise ConfigError("--lr and --alpha must be positive")
        if self.target not in TARGETS:
            raise ConfigError(f"unknown --target {self.target!r}; use {' or '.join(TARGETS)}")


def corpus_windows(tokenizer, text: str, n: int, ctx: int, seed: int) -> list[list[int]]:
    """n windows of ctx tokens from random line starts of `text` (deterministic in seed); the
    tokenizer's leading <|endoftext|> dropped, as a window inside a document has none."""
    rng = random.Random(seed)
    chars = 8 * ctx  # well over ctx tokens of Python source (about 4 characters per token)
    if len(text) < chars + 2:
        raise ConfigError(f"the corpus has {len(text)} characters; windows need {chars + 2}")
    out = []
    while len(out) < n:
        i = rng.randrange(0, len(text) - chars)
        j = text.find("\n", i, i + chars // 2) + 1 or i
        ids = tokenizer.encode(text[j : j + chars])[1 : ctx + 1]
        if len(ids) == ctx:
            out.append(ids)
    return out


def lr_at(step: int, total: int, peak: float) -> float:
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def logits_of(model, ids: list[int]) -> torch.Tensor:
    """logits [T, V] fp32 of one window from position 0 (gradients wherever they are enabled)."""
    cache = KVCache(model.args, len(ids), model.dtype, model.device)
    return model(torch.tensor(ids, device=model.device), cache, 0).float()


def distill_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student): the cross-entropy to the teacher's softmax
    less its entropy (same gradients; the entropy would hide the progress in the loss curve)."""
    lt = teacher.log_softmax(-1)
    return (lt.exp() * (lt - student.log_softmax(-1))).sum(-1).mean()


def tail_topk_reverse_kl(student: torch.Tensor, teacher: torch.Tensor, k: int) -> torch.Tensor:
    """Mean reverse KL(q || p) on the student's top-k tokens plus one bin holding the rest of
    each distribution's mass; student/teacher logits [T, V]."""
    ls, lt = student.log_softmax(-1), teacher.log_softmax(-1)
    top = ls.topk(k, dim=-1).indices
    qs, qt = ls.gather(1, top), lt.gather(1, top)  # log-probs of the top-k [T, k]
    tail_s = torch.log1p(-qs.exp().sum(-1).clamp(max=1 - 1e-6))
    tail_t = torch.log1p(-qt.exp().sum(-1).clamp(max=1 - 1e-6))
    q = torch.cat((qs, tail_s[:, None]), dim=1)
    p = torch.cat((qt, tail_t[:, None]), dim=1)
    return (q.exp() * (q - p)).sum(-1).mean()


class RecoveryTrainer:
    """student: the model running the StudentPath provider, adapters attached and trainable;
    teacher: the fp32 model with exact routing; sampler(prompt, n, gen) -> the student's tokens
    (stage 3; None without it)."""

    def __init__(self, student, teacher, params, cfg: RecoveryConfig, sampler=None):
        self.student, self.teacher, self.cfg, self.sampler = student, teacher, cfg, sampler
        self.params = list(params)
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(cfg.seed)

    def _step(self, lr: float, losses) -> float:
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for loss in losses:  # one window at a time: its graph is freed before the next
            (loss / self.cfg.batch).backward()
            total += float(loss.detach()) / self.cfg.batch
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        return total

    def distill_step(self, step: int, windows: list[list[int]]) -> float:
        lr = lr_at(step, self.cfg.steps, self.cfg.lr)
        return self._step(lr, (self._window_loss(w) for w in windows))

    def _window_loss(self, ids: list[int]) -> torch.Tensor:
        s = logits_of(self.student, ids)
        if self.cfg.target == "text":
            return F.cross_entropy(s[:-1], torch.tensor(ids[1:], device=s.device))
        with torch.no_grad():
            t = logits_of(self.teacher, ids)
        return distill_loss(s, t)

    def on_policy_step(self, step: int, prompts: list[list[int]]) -> float:
        lr = lr_at(step, self.cfg.on_policy_steps, self.cfg.lr / 2)
        return self._step(lr, (self._policy_loss(p) for p in prompts))

    def _policy_loss(self, prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            seq = prompt + self.sampler(prompt, self.cfg.gen_tokens, self.gen)
            t = logits_of(self.teacher, seq)
        s = logits_of(self.student, seq)
        a = len(prompt) - 1  # the logits that predicted the generated tokens
        return tail_topk_reverse_kl(s[a:-1], t[a:-1], self.cfg.top_k)


def eval_loss(trainer: RecoveryTrainer, windows: list[list[int]]) -> float:
    """The stage-2 loss on held windows, no gradients."""
    with torch.no_grad():
        return sum(float(trainer._window_loss(w)) for w in windows) / max(1, len(windows))


def student_sampler(model, heads, path_provider, inner, temperature: float = 1.0):
    """sampler(prompt, n, gen) for stage 3: the student decodes token by token under
    `--routing predicted` (PredictingExperts + the prerouter, the adapter attached), sampling at
    `temperature`; the student path is the model's provider again afterwards."""
    from moestream.experts.predicting import PredictingExperts
    from moestream.predict.prerouter import PrerouterPredictor

    stepwise = PredictingExperts(inner, PrerouterPredictor(heads), model.moe_blocks, "predicted")

    def sample(prompt: list[int], n: int, gen: torch.Generator) -> list[int]:
        model.set_provider(stepwise)
        stepwise.reset()
        try:
            cache = KVCache(model.args, len(prompt) + n, model.dtype, model.device)
            seq, out = list(prompt), []
            for pos in range(len(prompt) + n - 1):
                tok = torch.tensor([seq[pos]], device=model.device)
                logits = model(tok, cache, pos, last_only=True)[-1]
                if pos >= len(prompt) - 1:  # sampled on the CPU: `gen` is a CPU generator
                    probs = (logits.float() / temperature).softmax(-1).cpu()
                    seq.append(int(torch.multinomial(probs, 1, generator=gen)))
                    out.append(seq[-1])
            return out
        finally:
            model.set_provider(path_provider)

    return sample


def student_on(student_rt, device: str):
    """The student runtime (opened with `STUDENT_EXPERTS`) on `device`: itself on the CPU; on a
    GPU a copy whose model is moved there with its experts dequantized once (BatchedExperts)."""
    from dataclasses import replace

    from moestream.experts.batched import BatchedExperts
    from moestream.store.format import Store

    if torch.device(device).type == "cpu":
        return student_rt
    model = student_rt.model.to(device)
    experts = BatchedExperts.from_store(Store(student_rt.folder), model.dtype).to(device)
    model.set_provider(experts)
    return replace(student_rt, provider=experts)


def teacher_on(teacher_rt, device: str):
    """The teacher runtime's model on `device`: as it is on the CPU; on a GPU moved there with its
    resident experts as BatchedExperts."""
    from moestream.experts.batched import BatchedExperts
    from moestream.experts.resident import ResidentExperts

    model, p = teacher_rt.model, teacher_rt.provider
    if torch.device(device).type == "cpu":
        return model
    if not isinstance(p, ResidentExperts):
        raise ConfigError(
            f"the teacher {teacher_rt.folder} runs on {device} only as a Hugging Face folder "
            "(experts loaded resident); pass -m a store converted from one, or that folder"
        )
    model.to(device)
    model.set_provider(BatchedExperts(p.w13, p.w2, p.b13, p.b2, p.act).to(device))
    return model


@contextlib.contextmanager
def deterministic(device: torch.device):
    """torch's deterministic algorithms on a GPU (index_add_ and the index backward without float
    atomics; cuBLAS with a fixed workspace, which it reads from the environment); nothing on the
    CPU, whose kernels are deterministic at a fixed thread count."""
    if device.type == "cpu":
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def fit(student_rt, teacher, heads, cfg: RecoveryConfig, text: str, on_step=None):
    """Attach a fresh adapter to student_rt's model and train it (stage 2, then stage 3 when
    cfg.on_policy_steps): student_rt = the runtime opened with `STUDENT_EXPERTS` (and moved by
    `student_on`), teacher = the fp32 model on the same device (`teacher_on`). Returns
    (AdapterInfo, history [{stage, step, loss, lr, seconds}])."""
    with deterministic(student_rt.model.device):
        return _fit(student_rt, teacher, heads, cfg, text, on_step)


def _fit(student_rt, teacher, heads, cfg: RecoveryConfig, text: str, on_step):
    from moestream.recovery.adapter import adapter_modules, add_adapter
    from moestream.recovery.student import StudentPath

    torch.manual_seed(cfg.seed)
    model = student_rt.model
    heads.to(model.device)
    model.requires_grad_(False)
    info = add_adapter(model, cfg.rank, cfg.alpha, seed=cfg.seed)
    params = [p for m in adapter_modules(model).values() for p in m.parameters()]
    for p in params:
        p.requires_grad_(True)
    inner = student_rt.provider
    path = StudentPath(inner, heads, model.moe_blocks)
    model.set_provider(path)
    sampler = student_sampler(model, heads, path, inner) if cfg.on_policy_steps else None
    trainer = RecoveryTrainer(model, teacher, params, cfg, sampler)
    tok, history = student_rt.tokenizer, []
    wins = corpus_windows(tok, text, cfg.steps * cfg.batch, cfg.ctx, cfg.seed)
    n_prompt = cfg.on_policy_steps * cfg.batch
    prompts = corpus_windows(tok, text, n_prompt, cfg.prompt_tokens, cfg.seed + 1)
    steps = [(2, i, trainer.distill_step, wins) for i in range(cfg.steps)]
    steps += [(3, i, trainer.on_policy_step, prompts) for i in range(cfg.on_policy_steps)]
    try:
        for stage, i, run, data in steps:
            t0 = time.perf_counter()  # reading each window's loss syncs the device
            loss = run(i, data[i * cfg.batch : (i + 1) * cfg.batch])
            history.append(_record(stage, i, loss, trainer, time.perf_counter() - t0))
            if on_step is not None:
                on_step(history[-1])
    finally:
        model.set_provider(inner)
    for p in params:
        p.requires_grad_(False)
    return info, history


def _record(stage: int, step: int, loss: float, trainer: RecoveryTrainer, seconds: float) -> dict:
    lr = trainer.opt.param_groups[0]["lr"]
    return {"stage": stage, "step": step, "loss": loss, "lr": lr, "seconds": seconds}

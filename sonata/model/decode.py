"""Generation, beside the model: `generate` (a parallel prefill, then a decoder one token per
sequence at a time), `generate_reference` (its oracle, token by token), the next-token
sampler, and the decoders. `Decoder(model, batch)` picks the engine once, when it is built:
`FusedDecoder` (one numba call per token for every layer and the head: a float32 model on
the CPU without int8) or `TorchDecoder` (the same step in preallocated torch buffers: any
device, dtype, int8; the fused one's reference) for Mamba-1; `StateDecoder` (the layers' own
steps, SSD's fused) for stacks with Mamba-2 layers. Both keep the same states (every layer's
conv ring buffer and SSM state, one tensor each) and prefill the same way.

It reads a `sonata.model.lm.MambaLM`'s parameters by name and imports nothing from
`sonata.model.lm` (imports run one way: model -> decode); `MambaLM.generate` calls `generate`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from sonata.model import families
from sonata.model.mamba import MambaBlock
from sonata.model.quant import fake_quant_int8, quantize_int8


def sample_next(logits, temperature: float = 1.0, top_k: int = 0, generator=None, out=None):
    """Next ids (b,) from logits (b, vocab): argmax at temperature <= 0, else a draw from
    softmax(logits / temperature) restricted to the top_k largest (0: all). A row whose quotient
    logits / temperature overflows float32 (a temperature of 1e-45, say: inf, or NaN where the
    temperature itself rounds to 0) takes its top token: the limit of the distribution as the
    temperature falls, where softmax would give NaN."""
    if temperature <= 0:
        return torch.argmax(logits, -1, out=out) if out is not None else logits.argmax(-1)
    lg = logits.float() / temperature
    certain = None
    if not bool(torch.isfinite(lg).all()):
        certain = (~torch.isfinite(lg) & torch.isfinite(logits)).any(-1)   # rows whose quotient overflowed
        lg = lg.masked_fill(certain[:, None], 0.0)                         # drawn from, then replaced
    if top_k and top_k < lg.shape[-1]:
        kth = lg.topk(top_k, dim=-1).values[:, -1:]
        lg = lg.masked_fill_(lg < kth, float("-inf"))
    nxt = torch.multinomial(F.softmax(lg, -1), 1, generator=generator)[:, 0]
    if certain is not None:
        nxt = torch.where(certain, logits.argmax(-1), nxt)
    return out.copy_(nxt) if out is not None else nxt


ONE_THREAD_MACS = 2**20


class _LayerWeights:
    """One layer's tensors as the decode step reads them (views of the parameters, made once)."""

    def __init__(self, layer: MambaBlock, conv: torch.Tensor, ssm: torch.Tensor):
        m, c = layer.mixer, layer.mixer.cfg
        w = _decode_weight
        p = m.in_proj.weight
        k = c.d_conv
        self.norm_w, self.norm_eps = layer.norm.weight, layer.norm.eps
        self.in_wt = w(m.in_proj).t()                                   # (d, 2di)
        cw = m.conv1d.weight[:, 0, :]                                   # (di, k)
        # ring buffer of the last k inputs, slot (t mod k) holds input t; with the next write at
        # slot s, slot j holds the input (s - j) mod k steps back: tap k-1-((s - j) mod k)
        self.conv_w = torch.stack([torch.stack([cw[:, k - 1 - ((s - j) % k)] for j in range(k)])
                                   for s in range(k)])                  # (k slots, k, di)
        self.conv_b = m.conv1d.bias
        self.x_wt = w(m.x_proj).t()                                     # (di, r + 2n)
        self.dt_wt, self.dt_b = w(m.dt_proj).t(), m.dt_proj.bias        # (r, di), (di,)
        self.A = m.A.to(p.dtype)                                        # (di, n)
        self.D = m.D
        self.out_wt = w(m.out_proj).t()                                 # (di, d)
        self.conv = conv                                                # (b, k, di) ring buffer
        self.ssm = ssm                                                  # (b, di, n)


def _decode_weight(m: nn.Module) -> torch.Tensor:
    return fake_quant_int8(m.weight).detach() if getattr(m, "int8", False) else m.weight.detach()


class _Decoder:
    """What both engines share: the states, the prefill, the thread setting, `step`."""

    fused = False

    def __init__(self, model: nn.Module, batch: int):
        c = model.cfg
        p = model.embedding.weight
        b, di, n, k = batch, c.d_inner, c.d_state, c.d_conv
        nl = len(model.layers)
        self.model, self.batch, self.k, self.pos = model, batch, k, 0
        # A step of a small model is ~40 tiny ops: splitting them over OpenMP threads costs more
        # than it saves, and on a busy machine a waiting thread pool costs milliseconds a step
        # (measured: 0.2 vs 2-30 ms at batch 1 on 2 shared cores). Torch steps run on one thread
        # while the in_proj work per step is under ~1M multiply-adds; the fused step runs no
        # torch ops at all.
        self.one_thread = (not self.fused and p.device.type == "cpu"
                           and b * c.d_model * 2 * di < ONE_THREAD_MACS)
        self._inside = False
        if not families.fused_decode(c):
            return                                                      # StateDecoder: the layers' own states
        with torch.inference_mode():
            # every layer's states in one tensor each, so the fused step takes them in one argument
            self.conv_state = p.new_zeros(nl, b, k, di)                 # ring buffers
            self.ssm_state = p.new_zeros(nl, b, di, n)
            self.logits = p.new_empty(b, c.vocab_size)

    @torch.inference_mode()
    def prefill(self, prompt) -> torch.Tensor:
        """Consume prompt (b, T) in one parallel pass; logits after its last token (b, vocab)."""
        return self._load(*self.model.prefill(prompt))

    def _load(self, logits, states) -> torch.Tensor:
        """Take the model's layer states (conv (b, di, k) newest last, ssm) into the rings and
        the logits after the last token (b, vocab) into the buffer -> the logits."""
        for i, (conv, ssm) in enumerate(states):
            self.conv_state[i].copy_(conv.transpose(1, 2))              # newest in slot k-1
            self.ssm_state[i].copy_(ssm)
        self.pos = 0                                                    # so the next write is slot 0
        self.logits.copy_(logits)
        return self.logits

    @torch.inference_mode()
    def extend(self, tokens) -> torch.Tensor:
        """Consume tokens (b, T) after the ones already in the state, in one parallel pass of
        the model from that state (its chunked forward) -> the logits after the last (b,
        vocab): what `step`ping them one by one gives, without T separate steps."""
        k = self.k
        order = [(self.pos + j) % k for j in range(k)]                 # ring slots, oldest first
        states = [(self.conv_state[i][:, order].transpose(1, 2).contiguous(), self.ssm_state[i].clone())
                  for i in range(self.conv_state.shape[0])]
        logits, states = self.model(tokens, states, return_state=True)
        return self._load(logits[:, -1], states)

    @torch.inference_mode()
    def snapshot(self) -> "DecodeState":
        """A copy of the decoding state as it stands (every layer's conv window and SSM state,
        the KV cache of attention layers, the logits after the last token): `restore` puts it
        back, here or in another decoder of the same model, as often as asked."""
        if hasattr(self, "conv_state"):
            return DecodeState("stacked", (self.conv_state.clone(), self.ssm_state.clone()), self.pos,
                               self.logits.clone())
        return DecodeState("layers", _clone(self.states), 0, self.logits.clone())

    @torch.inference_mode()
    def restore(self, snap: "DecodeState") -> torch.Tensor:
        """Continue from `snap` (a `snapshot` of this model's decoder at this batch, or at batch
        1: then every sequence of the batch continues from it) -> its logits (b, vocab). The
        next `step` is what it would have been right after the snapshot, bit for bit."""
        if snap.batch not in (1, self.batch):
            raise ValueError(f"a snapshot of {snap.batch} sequences cannot continue {self.batch}")
        if snap.kind != ("stacked" if hasattr(self, "conv_state") else "layers"):
            raise ValueError("the snapshot is of another model's decoder")
        try:
            if snap.kind == "stacked":
                conv, ssm = snap.states
                self.conv_state.copy_(conv.expand_as(self.conv_state))   # in place: the fused step
                self.ssm_state.copy_(ssm.expand_as(self.ssm_state))      # reads these very buffers
                self.logits.copy_(snap.logits.expand_as(self.logits))
                self.pos = snap.pos
                return self.logits
        except RuntimeError:                                             # shapes of another model
            raise ValueError("the snapshot is of another model's decoder") from None
        self.states = _clone(snap.states, self.batch if snap.batch != self.batch else None)
        self.logits = snap.logits.expand(self.batch, -1).clone()
        return self.logits

    @contextlib.contextmanager
    def threads(self):
        """Run the block on one torch thread when `one_thread` says so (restored after); steps
        inside it switch nothing."""
        n = torch.get_num_threads()
        if not self.one_thread or n == 1 or self._inside:
            yield
            return
        torch.set_num_threads(1)
        self._inside = True
        try:
            yield
        finally:
            self._inside = False
            torch.set_num_threads(n)

    @torch.inference_mode()
    def step(self, idx) -> torch.Tensor:
        """Feed idx (b,); logits (b, vocab) in a buffer the next call overwrites."""
        if not self.one_thread or self._inside or torch.get_num_threads() == 1:
            return self._step(idx)
        with self.threads():
            return self._step(idx)


class FusedDecoder(_Decoder):
    """The step as one fused numba call (`sonata.kernels.selective.decode_cpu.step`) on float32 numpy
    copies of the weights, made once here (transposed and stacked over the layers), and views
    of the state and logits tensors (shared memory: `prefill` writes what the kernel reads)."""

    fused = True

    def __init__(self, model: nn.Module, batch: int, weights: str = "fp32"):
        super().__init__(model, batch)
        from sonata.kernels.selective import decode_cpu                # ImportError without numba

        def arr(ts):   # stacked float32 copies, by numpy: no torch thread pool to wake per copy
            return np.ascontiguousarray(np.stack([t.detach().numpy() for t in ts]))

        p = model.embedding.weight
        mix = [layer.mixer for layer in model.layers]
        with torch.no_grad():
            norms = [layer.norm for layer in model.layers] + [model.norm_f]
            # the five projections (L, n_in, n_out) in `weights`' storage, with their scales
            proj = [[m.in_proj.weight for m in mix], [m.x_proj.weight for m in mix],
                    [m.dt_proj.weight for m in mix], [m.out_proj.weight for m in mix], [model.lm_head.weight]]
            stored = [packed_weights(ws, weights) for ws in proj]
            (in_wt, in_s), (x_wt, x_s), (dt_wt, dt_s), (out_wt, out_s), (head_t, head_s) = stored
            self._weights = (
                np.ascontiguousarray(p.detach().numpy()),                           # emb (vocab, d)
                arr([m.weight for m in norms]),                                     # (L + 1, d)
                np.array([m.eps for m in norms], dtype=np.float32),
                in_wt,                                                              # (L, d, 2 di)
                arr([m.conv1d.weight[:, 0, :].t() for m in mix]),                   # (L, k, di)
                arr([m.conv1d.bias for m in mix]),                                  # (L, di)
                x_wt,                                                               # (L, di, r + 2n)
                dt_wt,                                                              # (L, r, di)
                arr([m.dt_proj.bias for m in mix]),                                 # (L, di)
                arr([m.A for m in mix]),                                            # (L, di, n)
                arr([m.D for m in mix]),                                            # (L, di)
                out_wt,                                                             # (L, di, d)
                head_t[0],                                                          # head (d, vocab)
                WEIGHT_KINDS[weights], in_s, x_s, dt_s, out_s, head_s[0],
            )
        self.weights = weights
        self._kernel = decode_cpu.step
        self._tail = (self.conv_state.numpy(), self.ssm_state.numpy(), self.logits.numpy())

    def _step(self, idx) -> torch.Tensor:
        slot = self.pos
        self.pos = (slot + 1) % self.k
        self._kernel(idx.numpy(), slot, *self._weights, *self._tail)
        return self.logits


# a decoder's weight storage -> decode_cpu's `wkind` (FP32, INT8, BF16)
WEIGHT_KINDS = {"fp32": 0, "int8": 1, "bf16": 2}


def packed_weights(ws, weights: str):
    """Linear weights ws (each (n_out, n_in)) -> (stacked transposed storage (len, n_in,
    n_out), stacked scales (len, n_out)) for the fused step: float32 (scales all 1, unread),
    int8 (`quantize_int8`: one scale per output), or bfloat16 bit patterns as uint16."""
    if weights == "int8":
        qs = [quantize_int8(w) for w in ws]
        return (np.ascontiguousarray(np.stack([q.t().numpy() for q, _ in qs])),
                np.ascontiguousarray(np.stack([sc.numpy() for _, sc in qs])))
    ones = np.ones((len(ws), ws[0].shape[0]), np.float32)
    if weights == "bf16":
        return np.ascontiguousarray(np.stack([w.detach().t().to(torch.bfloat16).view(torch.int16).numpy()
                                              .view(np.uint16) for w in ws])), ones
    return np.ascontiguousarray(np.stack([w.detach().t().numpy() for w in ws])), ones


def dequantized_copy(model: nn.Module, weights: str) -> nn.Module:
    """A copy of a Mamba-1 `model` whose five decode projections (in, x, dt, out, head) hold
    what `weights` storage rounds them to, in float32: the oracle the fused int8 / bf16 step
    is held to (its float32 step on these weights)."""
    import copy

    twin = copy.deepcopy(model)
    if twin.lm_head.weight is twin.embedding.weight:    # tied: the head is rounded, the lookup is not
        twin.lm_head.weight = nn.Parameter(twin.embedding.weight.detach().clone())
    with torch.no_grad():
        mods = [m for layer in twin.layers for m in (layer.mixer.in_proj, layer.mixer.x_proj,
                                                     layer.mixer.dt_proj, layer.mixer.out_proj)]
        for m in mods + [twin.lm_head]:
            w = m.weight
            if weights == "int8":
                q, sc = quantize_int8(w)
                w.copy_(q.float() * sc[:, None])
            elif weights == "bf16":
                w.copy_(w.to(torch.bfloat16).float())
    return twin


class TorchDecoder(_Decoder):
    """The step in torch ops, every tensor allocated once here: `out=` and in-place ops through
    views made once (no slicing, no new state tensors per token); the convolution window is a
    ring buffer read with the taps rotated to its write position. Any device, dtype, int8."""

    def __init__(self, model: nn.Module, batch: int):
        super().__init__(model, batch)
        c = model.cfg
        p = model.embedding.weight
        b, d, di, n, r, k = batch, c.d_model, c.d_inner, c.d_state, c.effective_dt_rank, c.d_conv
        with torch.inference_mode():
            self.layers = [_LayerWeights(layer, self.conv_state[i], self.ssm_state[i])
                           for i, layer in enumerate(model.layers)]
            self.emb = p.detach()
            self.head_wt = _decode_weight(model.lm_head).t()            # (d, vocab)
        self.norm_w, self.norm_eps, self.dshape = model.norm_f.weight, model.norm_f.eps, (d,)
        new = p.new_empty
        self.h = new(b, d)
        self.xz = new(b, 2 * di)
        self.x, self.z = self.xz[:, :di], self.xz[:, di:]                # views, made once
        self.tmp = new(b, k, di)
        self.tmp_sum, self.xc_pre, self.xc = new(b, di), new(b, di), new(b, di)
        self.xdbl = new(b, r + 2 * n)
        self.dt_in = self.xdbl[:, :r]
        self.B3 = self.xdbl[:, None, r:r + n]                           # (b, 1, n)
        self.C3 = self.xdbl[:, r + n:, None]                            # (b, n, 1)
        self.dt = new(b, di)
        self.dt3 = self.dt[:, :, None]
        self.zero = p.new_zeros(())
        self.dtA, self.dA = new(b, di, n), new(b, di, n)
        self.dtx = new(b, di)
        self.dtx3 = self.dtx[:, :, None]
        self.y = new(b, di)
        self.y3 = self.y[:, :, None]
        self.g = new(b, di)

    def _step(self, idx) -> torch.Tensor:
        h, slot = self.h, self.pos
        self.pos = (slot + 1) % self.k
        torch.index_select(self.emb, 0, idx, out=h)
        for lw in self.layers:
            hn = F.rms_norm(h, self.dshape, lw.norm_w, lw.norm_eps)
            torch.mm(hn, lw.in_wt, out=self.xz)
            lw.conv[:, slot].copy_(self.x)
            torch.mul(lw.conv, lw.conv_w[slot], out=self.tmp)
            torch.sum(self.tmp, 1, out=self.tmp_sum)
            torch.add(self.tmp_sum, lw.conv_b, out=self.xc_pre)
            torch.sigmoid(self.xc_pre, out=self.xc)
            self.xc.mul_(self.xc_pre)                                   # silu
            torch.mm(self.xc, lw.x_wt, out=self.xdbl)
            torch.addmm(lw.dt_b, self.dt_in, lw.dt_wt, out=self.dt)
            torch.logaddexp(self.dt, self.zero, out=self.dt)            # softplus
            torch.mul(self.dt3, lw.A, out=self.dtA)
            torch.exp(self.dtA, out=self.dA)       # not exp_: in place it is ~100x slower here
            lw.ssm.mul_(self.dA)
            torch.mul(self.dt, self.xc, out=self.dtx)
            lw.ssm.addcmul_(self.dtx3, self.B3)                         # + dt*x*B
            torch.bmm(lw.ssm, self.C3, out=self.y3)                     # y = h @ C
            self.y.addcmul_(self.xc, lw.D)
            torch.sigmoid(self.z, out=self.g)
            self.g.mul_(self.z)                                         # silu(z)
            self.y.mul_(self.g)
            h.addmm_(self.y, lw.out_wt)
        torch.mm(F.rms_norm(h, self.dshape, self.norm_w, self.norm_eps), self.head_wt, out=self.logits)
        return self.logits


class StateDecoder(_Decoder):
    """Any recurrent stack with Mamba-2 layers (mamba2, or mamba and mamba2 mixed): the layers'
    own `prefill` and `step`, the SSD layers stepping through the fused `ssd_step` (their state
    updated in place)."""

    def prefill(self, prompt) -> torch.Tensor:
        with torch.inference_mode():
            self.logits, states = self.model.prefill(prompt)
            # contiguous from the first step on: a layer's fused step takes contiguous states (a
            # prefill can hand back views), so every step runs the same kernel, and a state put
            # back by `restore` (a contiguous copy) continues exactly as this one does
            self.states = _map(states, torch.Tensor.contiguous)
        return self.logits

    def _step(self, idx) -> torch.Tensor:
        self.logits, self.states = self.model.step(idx, self.states)
        return self.logits

    @torch.inference_mode()
    def extend(self, tokens) -> torch.Tensor:
        logits, states = self.model(tokens, self.states, return_state=True)
        self.states = _map(states, torch.Tensor.contiguous)
        self.logits = logits[:, -1]
        return self.logits


@dataclass(frozen=True)
class DecodeState:
    """A decoder's state after some tokens (`_Decoder.snapshot`): `kind` "stacked" (Mamba-1's
    decoders: `states` is (conv rings, SSM states), each stacked over the layers) or "layers"
    (each layer's own state, attention's (k, v) included), `pos` (the conv rings' next slot),
    `logits` (b, vocab) after the last token. Its tensors are copies: the decoder goes on
    without changing them."""
    kind: str
    states: object
    pos: int
    logits: torch.Tensor

    @property
    def batch(self) -> int:
        return self.logits.shape[0]


def _map(x, fn):
    """fn applied to every tensor of a nested state (tensors in tuples and lists)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map(v, fn) for v in x)
    return x


def _clone(x, batch: int | None = None):
    """A contiguous copy of a nested state; `batch`: each tensor's first dimension (1) repeated
    to that many sequences."""
    return _map(x, (lambda t: t.repeat(batch, *([1] * (t.dim() - 1)))) if batch else
                (lambda t: t.clone(memory_format=torch.contiguous_format)))


def Decoder(model: nn.Module, batch: int, fused: bool | None = None, weights: str = "fp32") -> _Decoder:  # noqa: N802
    """The decoder for `model` at `batch` sequences, its engine picked here: fused=None, the
    fused step whenever it can run (a float32 model on the CPU, no int8, numba installed);
    True, required (a ValueError where it cannot); False, the torch step. `weights`: how the
    fused Mamba-1 step stores the projections and the head, "fp32", or weight-only "int8"
    (sonata's per-output int8, dequantized in the loop) or "bf16" (a quarter / half the bytes
    read per token; the state and every other sum stay float32)."""
    p = model.embedding.weight
    if weights not in WEIGHT_KINDS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_KINDS)}, not {weights!r}")
    if weights != "fp32":
        if not families.fused_decode(model.cfg) or p.device.type != "cpu" or p.dtype != torch.float32 \
                or fused is False:
            raise ValueError(f"weights={weights} is the fused Mamba-1 step's (a float32 Mamba-1 model on the "
                             f"CPU); this model steps its layers in {p.dtype} on {p.device.type}")
        return FusedDecoder(model, batch, weights)
    if not families.fused_decode(model.cfg):
        if fused:
            raise ValueError("the fused decode step is Mamba-1's; a model with mamba2 layers steps its layers")
        return StateDecoder(model, batch)
    int8 = any(getattr(m, "int8", False) for m in model.modules())
    can = p.device.type == "cpu" and p.dtype == torch.float32 and not int8
    if fused is True and not can:
        raise ValueError("the fused decode step needs a float32 model on the CPU without int8")
    if fused is not False and can:
        try:
            return FusedDecoder(model, batch)
        except ImportError:                                             # numba missing
            if fused:
                raise
    return TorchDecoder(model, batch)


@torch.inference_mode()
def generate(model: nn.Module, prompt, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             generator: torch.Generator | None = None, stop_token=None, pad: int | None = None,
             weights: str = "fp32") -> torch.Tensor:
    """Sampling (greedy at temperature <= 0): prompt (b, T) int64 -> (b, T + new) ids; stops
    early once every row has produced a stop token (`stop_token`: an id or a list of ids).
    With `pad`, a row that has stopped gets `pad` in its later columns (transformers' rule
    for eos and pad_token_id); without, it keeps sampling until every row has stopped. The
    prompt is consumed in one parallel pass, then a `Decoder` steps with preallocated
    buffers (`generate_reference` is the token-by-token original it is tested against).
    `weights`: the decoder's weight storage (`Decoder`)."""
    dec = Decoder(model, prompt.shape[0], weights=weights)
    b, T = prompt.shape
    out = torch.empty(b, T + max_new_tokens, dtype=torch.long, device=prompt.device)
    out[:, :T] = prompt
    logits = dec.prefill(prompt)
    stops = None
    if stop_token is not None and not (isinstance(stop_token, (list, tuple)) and not stop_token):
        stops = torch.tensor(stop_token if isinstance(stop_token, (list, tuple)) else [stop_token],
                             dtype=torch.long, device=prompt.device)
    running = torch.ones(b, dtype=torch.bool, device=prompt.device)
    n = 0
    with dec.threads():
        for i in range(max_new_tokens):
            nxt = out[:, T + i]
            sample_next(logits, temperature, top_k, generator, out=nxt)
            n = i + 1
            if stops is not None:
                if pad is not None:
                    nxt.masked_fill_(~running, pad)
                running &= ~torch.isin(nxt, stops)
                if not bool(running.any()):
                    break
            if i + 1 < max_new_tokens:
                logits = dec._step(nxt)       # already inside inference mode and dec.threads()
    return out[:, :T + n].clone() if n < max_new_tokens else out


@torch.no_grad()
def generate_reference(model: nn.Module, prompt, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                       generator: torch.Generator | None = None, stop_token: int | None = None) -> torch.Tensor:
    """`generate` written plainly: the prompt fed token by token through `model.step`, new
    state tensors every step. The oracle for `generate` and the decoders."""
    b = prompt.shape[0]
    dev = prompt.device
    states = [getattr(layer, "mixer", layer).empty_state(b, dev) for layer in model.layers]
    logits = None
    for t in range(prompt.shape[1]):
        logits, states = model.step(prompt[:, t], states)
    out = [prompt]
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    for _ in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, generator)
        out.append(nxt[:, None])
        if stop_token is not None:
            done |= nxt == stop_token
            if bool(done.all()):
                break
        logits, states = model.step(nxt, states)
    return torch.cat(out, dim=1)


__all__ = ["Decoder", "FusedDecoder", "StateDecoder", "TorchDecoder", "generate", "generate_reference", "sample_next"]

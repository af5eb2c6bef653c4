#!/usr/bin/env python3
"""benchmarks/peer/trainer_peer.py — the PyTorch 2.x peer of benchmarks/trainer_bench.cpp: eager,
or torch.compile (inductor) with --compile.

The same LLaMA (HF layout: fp32 RMSNorm, rotate_half RoPE, SwiGLU of LlamaConfig::ffn_size(),
untied head, normal(0, 0.02) init), the same optimizer (AdamW lr 3e-4, betas 0.9/0.95,
eps 1e-8, weight decay 0.1 on matrices only, no decay on 1-D params and embeddings, grad
clip 1.0, constant lr), the same loss normalisation (sum over each micro-batch divided by
the target count of the whole effective batch) and the same tokens (the LCG below). One
configuration per process; prints one JSON line with the C++ benchmark's keys.

Started with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (as torchrun or scripts/bench dist
start it) it is the data-parallel peer of benchmarks/dist/dist_bench.cpp: Gloo, the model in
DistributedDataParallel (bucket_cap_mb 25, no_sync on all but the last micro-batch), rank r
training rows r*micro/N .. (r+1)*micro/N - 1 of every global micro-batch, the target count
summed over the ranks; rank 0 prints the line. --fsdp2 (2+ ranks) puts PyTorch FSDP2 in DDP's
place, the peer of memopt's ZeRO-3: fully_shard over a 1-D Gloo CPU mesh on every decoder block,
then on the root (reshard_after_forward, fp32 parameters, no MixedPrecisionPolicy: bf16 comes
from the same autocast), set_requires_gradient_sync(False) on all but the last micro-batch (the
analogue of no_sync), the global-norm clip over the DTensor gradients, AdamW on the sharded
parameters. --deepspeed (2+ ranks) puts DeepSpeed ZeRO-3 there instead, on the CPU
(DS_ACCELERATOR=cpu, the same Gloo group): deepspeed.initialize with stage 3,
stage3_param_persistence_threshold 0 (every tensor sharded, as memopt's default), the same
AdamW as its client optimizer, gradient_clipping 1.0, gradient_accumulation_steps --accum with
engine.backward(loss, scale_wrt_gas=False) (the loss is already divided by the batch's target
count) and engine.step() after each micro-batch; fp32 weights, bf16 from the same autocast.
Every line says what each rank holds: param/grad/state_bytes_per_rank (the local
shards of DTensors or DeepSpeed's partitions and fp32 copies, the largest rank's) and
model_state_bytes_ranks.

Attention is F.scaled_dot_product_attention(is_causal=True): what a PyTorch 2.x user writes (its
CPU flash kernel never materialises the T x T scores).

--finetune lora: PEFT's get_peft_model(LoraConfig(r=--lora_rank, lora_alpha=2r, lora_dropout=0,
target_modules=--lora_targets)) over the frozen model, the optimizer on the adapters alone (the
peer of memopt::lora::apply). --finetune qlora: first every Linear of the blocks becomes
bitsandbytes' Linear4bit (NF4, blocksize 64, double quantisation, compute dtype the run's), its
weight quantised and the fp32 one dropped, layer by layer: PEFT's QLoRA recipe on the CPU.

    .venv/bin/python3 benchmarks/peer/trainer_peer.py --precision bf16 --recompute every [--compile]
"""
import argparse
import contextlib
import json
import os
import resource
import sys
import time
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

IGNORE_INDEX = -100
MASK64 = (1 << 64) - 1


class LcgTokenLoader:
    """Random tokens from a 64-bit LCG, identical to LcgTokenLoader in trainer_bench.cpp."""

    def __init__(self, batch, seq, vocab, seed):
        self.batch, self.seq, self.vocab, self.state = batch, seq, vocab, seed & MASK64

    def next(self):
        n = self.batch * (self.seq + 1)
        out = [0] * n
        s, vocab = self.state, self.vocab
        for i in range(n):
            s = (s * 6364136223846793005 + 1442695040888963407) & MASK64
            out[i] = (s >> 33) % vocab
        self.state = s
        rows = torch.tensor(out, dtype=torch.long).view(self.batch, self.seq + 1)  # (B, T+1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()                # (B, T) each


def cpu_flags():
    """The CPU flags that decide bf16 speed, as memopt::cpu_flags() lists them."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    found = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return " ".join(found) or "none"


def gemm_gflops(m, k, n, dtype, reps=3):
    """GFLOP/s of the fastest of `reps` (m x k)·(k x n) torch.mm in `dtype` (one untimed warm-up):
    memopt::machine::gemm_gflops's measurement."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)
    with torch.no_grad():
        torch.mm(a, b)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
    return 2.0 * m * k * n / max(best, 1e-9) / 1e9


def ffn_size(dim):
    """memopt::models::LlamaConfig::ffn_size(): 8/3 · dim rounded up to a multiple of 64."""
    raw = (8 * dim + 2) // 3
    return (raw + 63) // 64 * 64


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # (..., C)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(seq, head_dim, theta=10000.0):
    inv_freq = 1.0 / torch.pow(theta, torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    freqs = torch.outer(torch.arange(seq, dtype=torch.float), inv_freq)  # (T, D/2)
    emb = torch.cat([freqs, freqs], -1)                                   # (T, D)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


def apply_rope(x, cos, sin):
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):  # x (B, T, C)
        B, T, C = x.shape
        H, D = self.heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, H, D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, H, D).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, dim, heads, ffn):
        super().__init__()
        self.self_attn = Attention(dim, heads)
        self.mlp = SwiGLU(dim, ffn)
        self.input_layernorm = RMSNorm(dim)
        self.post_attention_layernorm = RMSNorm(dim)

    def forward(self, x, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nn.Module):
    def __init__(self, vocab, dim, layers, heads, ffn=0):
        super().__init__()
        self.heads = heads
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, dim)
        self.model.layers = nn.ModuleList([DecoderLayer(dim, heads, ffn or ffn_size(dim)) for _ in range(layers)])
        self.model.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)

    def forward(self, inputs, targets, checkpoint, reentrant):  # what DistributedDataParallel calls
        return self.loss_sum(inputs, targets, checkpoint, reentrant)

    def loss_sum(self, inputs, targets, checkpoint, reentrant):
        T = inputs.shape[1]
        cos, sin = rope_tables(T, self.model.embed_tokens.embedding_dim // self.heads)
        x = self.model.embed_tokens(inputs)  # (B, T, C)
        for layer in self.model.layers:
            if checkpoint:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=reentrant)
            else:
                x = layer(x, cos, sin)
        logits = self.lm_head(self.model.norm(x))  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")


LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_blocks(model, compute_dtype):
    """Every Linear of the blocks as bitsandbytes' Linear4bit (NF4, blocksize 64, double quantisation),
    one at a time: its fp32 weight goes as soon as its codes exist."""
    import bitsandbytes as bnb
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if not isinstance(child, nn.Linear):
                    continue
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False, compute_dtype=compute_dtype,
                                      compress_statistics=True, quant_type="nf4")
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                             compress_statistics=True, blocksize=64)
                setattr(parent, name, q.to("cpu"))  # quantises on the move
                del child
    return f"bitsandbytes {bnb.__version__} Linear4bit nf4"


def logical_numel(p):
    """A parameter's element count; a Linear4bit weight's is its unquantised shape's, not its packed bytes'."""
    state = getattr(p, "quant_state", None)
    if state is not None:
        return state.shape.numel()
    return getattr(p, "ds_numel", p.numel())  # a DeepSpeed ZeRO-3 parameter is empty between uses


def fully_shard_fn():
    """FSDP2's fully_shard: torch.distributed.fsdp since 2.6, torch.distributed._composable.fsdp before."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def local_bytes(t):
    """Bytes of this rank's storage of `t`: a DTensor's local shard, a plain tensor whole; None: 0."""
    if t is None:
        return 0
    if hasattr(t, "to_local"):  # DTensor (an FSDP2 parameter, its gradient, its AdamW moments)
        t = t.to_local()
    return t.numel() * t.element_size()


def deepspeed_engine(model, optimizer, args, world):
    """DeepSpeed ZeRO-3 over the initialised Gloo group, on the CPU (see the docstring)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    config = {
        "train_micro_batch_size_per_gpu": args.micro // world,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,  # torch.optim.AdamW, the other peers' optimizer
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": False,
                              "contiguous_gradients": True, "reduce_bucket_size": 25 << 20},
        "steps_per_print": 1 << 30,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return engine, f"deepspeed {deepspeed.__version__} ZeRO-3"


def deepspeed_bytes(engine):
    """This rank's DeepSpeed ZeRO-3 bytes: parameter partitions (and their fp32 copies), gradient partitions."""
    zero = engine.optimizer
    params = sum(local_bytes(getattr(p, "ds_tensor", p)) for p in engine.module.parameters())
    params += sum(local_bytes(t) for t in getattr(zero, "fp32_partitioned_groups_flat", []))
    grads = local_bytes(getattr(zero, "grad_partitions_flat_buffer", None))
    return params, grads


def add_adapters(model, rank, targets):
    import peft
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(targets))
    return peft.get_peft_model(model, config), f"peft {peft.__version__} LoRA"


GEMM_OPS = {"aten::mm": 0, "aten::bmm": 0, "aten::addmm": 1, "aten::addmm_": 1, "aten::baddbmm": 1, "aten::baddbmm_": 1}


def profile_step(step):
    """One step under torch.profiler (CPU ops, input shapes), reported as memopt_bench_trainer
    --profile reports its own (benchmarks/profile.hpp): the wall time, the 15 ops of most self
    time and the 12 GEMM shapes of most self time with the rate each ran at."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        step()
        wall_ms = (time.perf_counter() - start) * 1e3
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    gemms = []
    for e in prof.key_averages(group_by_input_shape=True):
        first = GEMM_OPS.get(e.key)
        shapes = e.input_shapes[first:first + 2] if first is not None else []
        if len(shapes) < 2 or len(shapes[0]) not in (2, 3) or len(shapes[0]) != len(shapes[1]):
            continue
        a, b = shapes
        flops = 2.0 * e.count * (a[0] if len(a) == 3 else 1) * a[-2] * a[-1] * b[-1]
        ms = e.self_cpu_time_total / 1e3
        gemms.append({"op": e.key, "shapes": " x ".join("(" + ", ".join(map(str, x)) + ")" for x in shapes),
                      "calls": e.count, "self_ms": ms, "share": ms / wall_ms, "gflops": flops / ms / 1e6})
    gemms.sort(key=lambda g: g["self_ms"], reverse=True)
    return {"profile_wall_ms": wall_ms,
            "profile": [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3,
                         "share": e.self_cpu_time_total / 1e3 / wall_ms, "calls": e.count} for e in ops],
            "profile_gemms": gemms[:12]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=0, help="0: all available CPUs")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--recompute", choices=["none", "every"], default="none")
    ap.add_argument("--reentrant", choices=["auto", "true", "false"], default="auto",
                    help="torch.utils.checkpoint's use_reentrant; auto: false, PyTorch 2.x's recommendation "
                         "(and the only one torch.compile traces)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (inductor)")
    ap.add_argument("--profile", action="store_true",
                    help="one more step under torch.profiler: the line's profile, profile_gemms (as memopt's)")
    ap.add_argument("--impl", choices=["pytorch"], default="pytorch")
    ap.add_argument("--ffn", type=int, default=0, help="SwiGLU width (0: memopt's 8/3 rule)")
    ap.add_argument("--finetune", choices=["full", "lora", "qlora"], default="full")
    ap.add_argument("--lora_rank", type=int, default=16)
    ap.add_argument("--lora_targets", default=",".join(LINEAR_NAMES),
                    help="comma-separated Linear names, or all-linear (the 7 of each block)")
    ap.add_argument("--fsdp2", action="store_true",
                    help="with WORLD_SIZE > 1: PyTorch FSDP2 (fully_shard per block + root over a Gloo CPU mesh) "
                         "instead of DistributedDataParallel")
    ap.add_argument("--deepspeed", action="store_true",
                    help="with WORLD_SIZE > 1: DeepSpeed ZeRO-3 on the CPU instead of DistributedDataParallel")
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if (args.fsdp2 or args.deepspeed) and world < 2:
        sys.exit("trainer_peer.py: --fsdp2 and --deepspeed shard over ranks; start 2 or more with RANK / WORLD_SIZE / "
                 f"MASTER_ADDR / MASTER_PORT (as torchrun does); WORLD_SIZE is {world}")
    if args.profile and world > 1:
        sys.exit(f"trainer_peer.py: --profile profiles one process; WORLD_SIZE is {world}. HINT: drop --profile, or "
                 "run without RANK / WORLD_SIZE")
    if args.deepspeed and (args.fsdp2 or args.finetune != "full" or args.compile):
        sys.exit("trainer_peer.py: --deepspeed is the full fine-tune peer of memopt's ZeRO-3, alone (no --fsdp2, "
                 "--finetune or --compile)")
    if args.fsdp2 and args.finetune == "qlora":
        sys.exit("trainer_peer.py: --fsdp2 with --finetune qlora is not supported: fully_shard's all-gathered "
                 "Linear4bit weights lose their Params4bit quant_state (bitsandbytes: 'ValueError: quant_state is "
                 "required' in the first forward)")
    if world > 1:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        dist.init_process_group("gloo")
        if args.micro % world:
            sys.exit(f"trainer_peer.py: --micro {args.micro} does not split over {world} ranks")
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    bf16 = args.precision == "bf16"
    checkpoint = args.recompute == "every"
    reentrant = args.reentrant == "true"

    model = Llama(args.vocab, args.dim, args.layers, args.heads, args.ffn)
    peer_finetune = []
    if args.finetune == "qlora":
        peer_finetune.append(quantize_blocks(model, torch.bfloat16 if bf16 else torch.float32))
    if args.finetune != "full":
        targets = LINEAR_NAMES if args.lora_targets == "all-linear" else args.lora_targets.split(",")
        model, what = add_adapters(model, args.lora_rank, targets)
        peer_finetune.append(what)
    model.train()
    if args.fsdp2:  # after the (identical, seeded) initialisation; before the optimizer sees the parameters
        from torch.distributed.device_mesh import init_device_mesh
        fully_shard = fully_shard_fn()
        mesh = init_device_mesh("cpu", (world,))  # 1-D, over the default (Gloo) process group
        llama = model.get_base_model() if args.finetune != "full" else model  # PEFT: shard the Llama inside
        for layer in llama.model.layers:
            fully_shard(layer, mesh=mesh)  # reshard_after_forward=True by default
        fully_shard(llama, mesh=mesh)      # the root: embedding, final norm, head
        sharded = llama                    # its parameters are now DTensors, Shard(0) over the ranks
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trainable if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in trainable if not (p.dim() >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    params = [p for _, p in trainable]
    loader = LcgTokenLoader(args.micro, args.seq, args.vocab, args.seed)
    rows = slice(rank * args.micro // world, (rank + 1) * args.micro // world)  # this rank's rows
    ddp = world > 1 and not args.fsdp2 and not args.deepspeed
    trained = DistributedDataParallel(model, bucket_cap_mb=25) if ddp else model
    if args.deepspeed:  # the engine partitions the parameters and wraps the optimizer
        trained, peer_engine = deepspeed_engine(model, optimizer, args, world)
    if args.compile:
        trained = torch.compile(trained)  # compiles during the warm-up step(s)
    impl = "pytorch_compile" if args.compile else "pytorch"
    name = f"l{args.layers}-d{args.dim}-s{args.seq}-{args.precision}" + ("-ckpt" if checkpoint else "")
    if args.finetune != "full":
        name += f"-{args.finetune}"

    def step():
        micro_batches = [tuple(t[rows] for t in loader.next()) for _ in range(args.accum)]
        num_targets = sum((t != IGNORE_INDEX).sum() for _, t in micro_batches).float()
        if world > 1:
            dist.all_reduce(num_targets)  # the global batch's targets
        num_targets = num_targets.clamp_min(1)
        loss_sum = torch.zeros(())
        for i, (inputs, targets) in enumerate(micro_batches):
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
            last = i + 1 == len(micro_batches)
            sync = trained.no_sync() if ddp and not last else contextlib.nullcontext()
            if args.fsdp2:  # FSDP2's no_sync: unsharded gradients accumulate, one reduce-scatter at the last
                sharded.set_requires_gradient_sync(last)
            with sync:
                with autocast:
                    loss = trained(inputs, targets, checkpoint, reentrant).float() / num_targets
                if args.deepspeed:
                    trained.backward(loss, scale_wrt_gas=False)
                    if last:  # its gradient partitions, reduced, before the step
                        held["param"], held["grad"] = deepspeed_bytes(trained)
                    trained.step()  # steps (and clips) at the accumulation boundary only
                else:
                    loss.backward()
            loss_sum += loss.detach()
        if world > 1:
            dist.all_reduce(loss_sum)  # the global batch's mean loss
        if args.deepspeed:
            return loss_sum.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # DTensor gradients: the global norm over all shards
        held["grad"] = sum(local_bytes(p.grad) for p in params)  # this rank's gradients at the step
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss_sum.item()

    # The peak scripts/bench divides by for the line's mfu, as memopt_bench_trainer measures it: the faster of
    # before the steps and after them, each the fastest of 10 products (its kPeakReps).
    peak = partial(gemm_gflops, args.micro * args.seq, args.dim, ffn_size(args.dim) if args.ffn == 0 else args.ffn,
                   torch.bfloat16 if bf16 else torch.float32, reps=10)
    peak_before = peak()
    held = {}  # bytes this rank holds: parameters, gradients at the step, optimizer state after the first step
    times, losses, loss_first, loss_last = [], [], 0.0, 0.0
    for s in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = step()
        seconds = time.perf_counter() - start
        if s == 0:
            held["state"] = sum(local_bytes(v) for st in optimizer.state.values() for v in st.values()
                                if torch.is_tensor(v))
        losses.append(loss)
        if s == 0:
            loss_first = loss
        loss_last = loss
        if s >= args.warmup:
            times.append(seconds)
        if rank != 0:
            continue
        print(f"  {name} [{impl}] step {s}{' (warm-up)' if s < args.warmup else ''}: loss {loss:.6g}, "
              f"{seconds * 1e3:.1f} ms", file=sys.stderr)

    profiled = profile_step(step) if args.profile else {}  # untimed; its loss is not reported
    step_s = sum(times) / len(times)
    tokens_per_step = args.micro * args.accum * args.seq
    gemm = max(peak_before, peak())
    if not args.deepspeed:  # (DeepSpeed's, measured at the step)
        held["param"] = sum(local_bytes(p) for p in model.parameters())  # frozen ones too; FSDP2: the shards
    # each rank's [param, grad, state, peak RSS KiB], in rank order
    mine = torch.tensor([held["param"], held["grad"], held["state"],
                         resource.getrusage(resource.RUSAGE_SELF).ru_maxrss], dtype=torch.float64)
    if world > 1:
        each = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(each, mine)
    else:
        each = [mine]
    param_b, grad_b, state_b, rss_kib = ([int(t[k].item()) for t in each] for k in range(4))
    model_state_b = [p + g + s for p, g, s in zip(param_b, grad_b, state_b)]
    line = {
        "name": name,
        "impl": impl,
        "torch_version": torch.__version__,
        "cpu_flags": cpu_flags(),
        "tokens_per_s": tokens_per_step / step_s,
        "step_ms": step_s * 1e3,
        "step_ms_min": min(times) * 1e3,
        "step_ms_all": [t * 1e3 for t in times],
        "peak_rss_mib": max(rss_kib) / 1024.0,  # the largest rank's
        "peak_rss_mib_ranks": [k / 1024.0 for k in rss_kib],
        # what each rank holds (FSDP2: its shards): the largest rank's, and the sum per rank
        "param_bytes_per_rank": max(param_b),
        "grad_bytes_per_rank": max(grad_b),  # right before optimizer.step()
        "state_bytes_per_rank": max(state_b),  # the optimizer's state tensors after the first step
        "model_state_bytes_per_rank": max(model_state_b),
        "model_state_bytes_ranks": model_state_b,
        "model_state_mib_per_rank": max(model_state_b) / (1 << 20),  # memopt_bench_dist's unit
        "loss_first": loss_first,
        "loss_last": loss_last,
        "losses": losses,
        "params_m": sum(logical_numel(p) for p in model.parameters()) / 1e6,
        "trainable_m": sum(logical_numel(p) for p in params) / 1e6,
        "layers": args.layers,
        "dim": args.dim,
        "heads": args.heads,
        "seq": args.seq,
        "micro": args.micro,
        "accum": args.accum,
        "vocab": args.vocab,
        "steps": args.steps,
        "warmup": args.warmup,
        "precision": args.precision,
        "recompute": args.recompute,
        "threads": torch.get_num_threads(),
        "ranks": world,
        "gemm_gflops": gemm,
        "load_avg_1m": os.getloadavg()[0],  # other work on the machine skews the timings
        **profiled,
    }
    if args.finetune != "full":
        line.update(finetune=args.finetune, lora_rank=args.lora_rank, lora_targets=args.lora_targets,
                    peer_finetune=", ".join(peer_finetune))
    if checkpoint:
        line["peer_checkpoint"] = "use_reentrant=True" if reentrant else "use_reentrant=False"
    if args.fsdp2:
        line["peer_data_parallel"] = ("fully_shard(gloo cpu mesh), per block + root, reshard_after_forward, "
                                      "set_requires_gradient_sync")
    elif args.deepspeed:
        line["peer_data_parallel"] = (f"{peer_engine}, gloo, stage3_param_persistence_threshold 0, client AdamW, "
                                      "gradient_clipping 1.0")
    elif world > 1:
        line["peer_data_parallel"] = "DistributedDataParallel(gloo, bucket_cap_mb=25), no_sync"
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()

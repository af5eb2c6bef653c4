#!/usr/bin/env python3
"""tests/baselines/lora_reference.py — PEFT 0.21.2's LoRA on the toy model of tests/nn/lora_test.cpp,
for memopt/nn/lora.hpp and memopt/io/peft.hpp to reproduce.

  lora_reference.py IN OUT

The toy model (Toy below; the test builds the same with memopt::nn::LoraLinear):
  layers.N.q_proj  Linear(C, H), no bias      adapted (target_modules ["q_proj", "v_proj"])
  layers.N.v_proj  Linear(H, C), bias         adapted
  head             Linear(C, O), bias         not adapted
  forward: x = x + v_proj(tanh(q_proj(x))) for each layer, then head(x)

IN (a safetensors file written by memopt::io::save_safetensors) lists the jobs in its metadata
"jobs" (JSON: [{"name": J, "mode": ..., "r": ..., "lora_alpha": ..., "use_rslora": ..., ...}])
and holds per job J the input J/x and parameters J/<name> under memopt's names: PEFT's parameter
name without "base_model.model.", ".base_layer" and ".default". The script fails when the PEFT
model's names and IN's differ. Modes:
  forward  IN: every parameter, base and adapter. OUT: J/y, J/loss = mean(y²),
           J/grad/<adapter parameter>, J/delta/<module> (get_delta_weight), J/scaling/<module>,
           J/y_merged (after merge_adapter)
  load     IN: the base parameters; "dir": an adapter folder memopt::io::save_adapter wrote, loaded
           with PeftModel.from_pretrained (every file tensor checked to have arrived).
           OUT: J/y, J/scaling/<module>
  save     IN: the base parameters; "seed": A and B drawn N(0, 0.1²) after get_peft_model, then
           save_pretrained("dir"). OUT: J/y (eval mode), J/lora/<adapter parameter>
Deterministic: one thread; dropout is off for every output.

Exit status 0 on success, 1 when PEFT's model does not match IN (the reason on stderr), 2 on bad
usage or when peft or safetensors cannot be imported.
"""
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")

try:
    import torch
    import safetensors
    import safetensors.torch
    import peft
    from peft import LoraConfig, PeftModel, get_peft_model
except ImportError as e:
    sys.stderr.write(f"lora_reference.py: {e}. HINT: run scripts/deps (requirements.txt installs peft and "
                     "safetensors into .venv)\n")
    sys.exit(2)

TARGETS = ["q_proj", "v_proj"]


def fail(message):
    sys.stderr.write("lora_reference.py: " + message + "\n")
    sys.exit(1)


class Block(torch.nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.q_proj = torch.nn.Linear(c, h, bias=False)
        self.v_proj = torch.nn.Linear(h, c, bias=True)


class Toy(torch.nn.Module):
    def __init__(self, layers, c, h, o):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(c, h) for _ in range(layers)])
        self.head = torch.nn.Linear(c, o, bias=True)

    def forward(self, x):
        for block in self.layers:
            x = x + block.v_proj(torch.tanh(block.q_proj(x)))
        return self.head(x)


def memopt_name(peft_name):
    """PEFT's parameter name as memopt's LoraLinear names it."""
    name = peft_name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".").replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.",
                                                                                            ".lora_B.")


def is_adapter(name):
    return ".lora_A." in name or ".lora_B." in name


def build_base(params):
    """Toy with the base weights of `params` (memopt names), shapes read from them."""
    layers = sum(1 for k in params if k.startswith("layers.") and k.endswith(".q_proj.weight"))
    h, c = params["layers.0.q_proj.weight"].shape
    o = params["head.weight"].shape[0]
    model = Toy(layers, c, h, o)
    model.load_state_dict({k: v for k, v in params.items() if not is_adapter(k)}, strict=True)
    return model


def check_names(model, expected, job):
    names = {memopt_name(n) for n, _ in model.named_parameters()}
    if names != set(expected):
        fail(f"{job}: PEFT's parameters {sorted(names - set(expected))} are not in IN, IN's "
             f"{sorted(set(expected) - names)} not in PEFT's model")


def lora_modules(model):
    """memopt module path -> PEFT LoRA layer."""
    return {name.removeprefix("base_model.model."): m for name, m in model.named_modules()
            if isinstance(m, peft.tuners.lora.LoraLayer)}


def config(job):
    return LoraConfig(r=job["r"], lora_alpha=job["lora_alpha"], use_rslora=job["use_rslora"],
                      lora_dropout=job.get("lora_dropout", 0.0), target_modules=TARGETS)


def forward_job(job, params, x, out):
    name = job["name"]
    model = get_peft_model(build_base(params), config(job))
    check_names(model, params, name)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[memopt_name(n)])
    model.eval()
    y = model(x)
    loss = (y ** 2).mean()
    loss.backward()
    out[f"{name}/y"] = y.detach()
    out[f"{name}/loss"] = loss.detach()
    for n, p in model.named_parameters():
        if is_adapter(memopt_name(n)):
            out[f"{name}/grad/{memopt_name(n)}"] = p.grad
    for path, layer in lora_modules(model).items():
        out[f"{name}/delta/{path}"] = layer.get_delta_weight("default").detach()
        out[f"{name}/scaling/{path}"] = torch.tensor(layer.scaling["default"], dtype=torch.float64)
    model.merge_adapter()
    with torch.no_grad():
        out[f"{name}/y_merged"] = model(x)


def load_job(job, params, x, out):
    name, folder = job["name"], job["dir"]
    model = PeftModel.from_pretrained(build_base(params), folder)
    file = safetensors.torch.load_file(os.path.join(folder, "adapter_model.safetensors"))
    loaded = {memopt_name(n): p for n, p in model.named_parameters() if is_adapter(memopt_name(n))}
    stored = {memopt_name(k): v for k, v in file.items()}
    if set(loaded) != set(stored):
        fail(f"{name}: PEFT's adapter parameters {sorted(loaded)} differ from the file's {sorted(stored)}")
    for n, p in loaded.items():
        if not torch.equal(p.detach(), stored[n].to(p.dtype)):
            fail(f"{name}: PeftModel.from_pretrained did not load {n}")
    model.eval()
    with torch.no_grad():
        out[f"{name}/y"] = model(x)
    for path, layer in lora_modules(model).items():
        out[f"{name}/scaling/{path}"] = torch.tensor(layer.scaling["default"], dtype=torch.float64)


def save_job(job, params, x, out):
    name = job["name"]
    model = get_peft_model(build_base(params), config(job))
    generator = torch.Generator().manual_seed(job["seed"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if is_adapter(memopt_name(n)):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
                out[f"{name}/lora/{memopt_name(n)}"] = p.detach().clone()
    model.save_pretrained(job["dir"])
    model.eval()
    with torch.no_grad():
        out[f"{name}/y"] = model(x)


def main(path_in, path_out):
    torch.set_num_threads(1)
    with safetensors.safe_open(path_in, "pt") as f:
        jobs = json.loads((f.metadata() or {}).get("jobs", "[]"))
    tensors = safetensors.torch.load_file(path_in)
    if not jobs:
        fail(f"{path_in} lists no jobs in its metadata")
    out = {}
    for job in jobs:
        prefix = job["name"] + "/"
        params = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix) and k != prefix + "x"}
        run = {"forward": forward_job, "load": load_job, "save": save_job}.get(job["mode"])
        if run is None:
            fail(f"{job['name']}: unknown mode {job['mode']!r}")
        run(job, params, tensors[prefix + "x"], out)
    safetensors.torch.save_file({k: v.contiguous() for k, v in out.items()}, path_out)
    print(f"wrote {len(jobs)} jobs to {path_out} with peft {peft.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.stderr.write(__doc__)
        sys.exit(2)
    main(sys.argv[1], sys.argv[2])

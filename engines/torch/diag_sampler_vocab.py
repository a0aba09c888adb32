# (A one-off diagnostic for one GPU call: delete once the rate is measured.)
"""The Triton sampler before and after the fix of dd85dcd on this device: how many draws leave a
vocabulary of 624 tokens (qwen3-50m's) at the top 16 uniforms and at hashed ones. The kernel as
it was is kernels.py with the two lines put back, imported from a temporary file."""
import importlib.util, pathlib, sys, tempfile, torch
import slimen_torch.kernels as K
s = pathlib.Path(K.__file__).read_text().replace("tl.max(inner, 0))", "tl.sum(w, 0))").replace(
    "tok = tl.minimum(j * C + k, V - 1).to(tl.int64)", "tok = (j * C + k).to(tl.int64)")
assert "tl.sum(w, 0))" in s and "tok = (j * C + k)" in s
f = pathlib.Path(tempfile.mkdtemp()) / "kernels_before.py"
f.write_text(s)
spec = importlib.util.spec_from_file_location("slimen_torch.kernels_before", f)
O = importlib.util.module_from_spec(spec)
spec.loader.exec_module(O)
dev = "cuda" if torch.cuda.is_available() else "cpu"
n, V, reps = int(sys.argv[1]), 624, int(sys.argv[2])
g = torch.Generator(device=dev).manual_seed(0)
z = torch.zeros(n, dtype=torch.long, device=dev)
t = torch.ones(n, device=dev)
top = ((2 ** 24 - 1 - torch.arange(n, device=dev) % 16).double() + 0.5).div(2 ** 24).float()
bad = {"before": [0, 0], "after": [0, 0]}
for r in range(reps):
    x = (torch.randn(n, V, device=dev, generator=g) * 0.5).bfloat16()
    key = torch.randint(0, 2 ** 32, (n,), device=dev, generator=g)
    for name, M in (("before", O), ("after", K)):
        a, _ = M.sample_and_advance(x, t, z, z, u=top)  # the top 16 uniforms
        b, _ = M.sample_and_advance(x, t, key, z)  # hashed uniforms, as the decode step draws
        bad[name][0] += (a >= V).sum().item()
        bad[name][1] += (b >= V).sum().item()
for name, (a, b) in bad.items():
    print(f"{name}: out of vocabulary {a} of {n * reps} draws at the top 16 uniforms, "
          f"{b} of {n * reps} at hashed uniforms ({b / (n * reps):.2e} a draw)")

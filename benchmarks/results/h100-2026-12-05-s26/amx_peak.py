"""How fast can torch (oneDNN) BF16 GEMM go on this host's CPU: big square, and hot expert shapes."""
import time, torch
torch.set_num_threads(16)
def tf(fn, flops, it=10):
    fn(); t0 = time.perf_counter()
    for _ in range(it): fn()
    dt = (time.perf_counter() - t0) / it
    return flops / dt / 1e12, dt
a = torch.randn(4096, 4096).bfloat16(); b = torch.randn(4096, 4096).bfloat16()
print("mm 4096^3 bf16: %.2f TFLOPS" % tf(lambda: a @ b, 2 * 4096**3)[0], flush=True)
H, I = 2048, 512
for t in (64, 128, 256, 512, 1024):
    x = torch.randn(t, H).bfloat16(); w = torch.randn(2 * I, H).bfloat16()
    print("hot expert gate-up t=%d: %.2f TFLOPS" % (t, tf(lambda: torch.nn.functional.linear(x, w), 2 * t * H * 2 * I, 50)[0]), flush=True)
    ws = torch.randn(64, 2 * I, H).bfloat16(); xs = torch.randn(64, t, H).bfloat16()
    print("bmm 64 experts gate-up t=%d: %.2f TFLOPS" % (t, tf(lambda: torch.bmm(xs, ws.transpose(1, 2)), 64 * 2 * t * H * 2 * I, 5)[0]), flush=True)

import os, time, torch
print("capability", torch.backends.cpu.get_cpu_capability(), "mkldnn", torch.backends.mkldnn.is_available(), flush=True)
torch.set_num_threads(16)
a = torch.randn(4096, 4096).bfloat16(); b = torch.randn(4096, 4096).bfloat16()
for _ in range(3): c = a @ b
x = torch.randn(256, 2048).bfloat16(); w = torch.randn(1024, 2048).bfloat16()
y = torch.nn.functional.linear(x, w)
t0 = time.perf_counter()
for _ in range(5): c = a @ b
print("tflops", 5 * 2 * 4096**3 / (time.perf_counter() - t0) / 1e12, flush=True)

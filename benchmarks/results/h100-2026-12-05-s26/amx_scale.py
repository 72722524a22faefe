import time, torch
for nt in (1, 4, 8, 16):
    torch.set_num_threads(nt)
    n = 2048
    a = torch.randn(n, n).bfloat16(); b = torch.randn(n, n).bfloat16()
    for _ in range(2): a @ b
    it = 3 if nt == 1 else 10
    t0 = time.perf_counter()
    for _ in range(it): a @ b
    print("threads %2d mm %d^3 bf16 %.2f TFLOPS" % (nt, n, it * 2 * n**3 / (time.perf_counter() - t0) / 1e12), flush=True)

"""Which scale order does the carried Marlin MoE build read? Runs dsv4_kernels.marlin_moe with the library's scale
processing and with vLLM's (an extra pair interleave of k-groups), against the reference experts (GPU only)."""

import torch

from dsv4_kernels import marlin_moe
from dsv4_kernels import moe as ref
from dsv4_kernels.gpu import import_marlin_moe
from dsv4_kernels.quant import dequant_mxfp4


def vllm_scales(mm, parts, n, k):
    out = []
    for e in range(parts[0].shape[0]):
        s = marlin_moe._rows(parts, e).t().contiguous()
        s = mm.marlin_permute_scales(s, size_k=k, size_n=n, group_size=32)
        s = s.view(s.size(0) // 2, 2, -1, 8).permute(0, 2, 1, 3).reshape(s.size(0), -1)
        s = s.view(-1, 4)[:, [0, 2, 1, 3]].reshape(s.size(0), -1)
        out.append(s.view(torch.float8_e8m0fnu))
    return torch.stack(out)


def main():
    _, _, mm = import_marlin_moe()
    gen = torch.Generator(device="cuda").manual_seed(0)
    e, h, inter, k = 8, 512, 256, 4
    packed, dense = {}, {}
    for name, (n, kk) in (("w1", (inter, h)), ("w3", (inter, h)), ("w2", (h, inter))):
        w = torch.randint(0, 256, (e, n, kk // 2), dtype=torch.uint8, device="cuda", generator=gen)
        s = torch.randint(119, 124, (e, n, kk // 32), dtype=torch.uint8, device="cuda", generator=gen)
        packed[name], packed["s" + name[1]] = w, s
        dense[name] = dequant_mxfp4(w, s).to(torch.bfloat16)
    x = torch.randn(33, h, device="cuda", generator=gen).to(torch.bfloat16)
    gate = torch.randn(e, h, device="cuda", generator=gen) * h**-0.5
    weights, ids = ref.route(x, gate, k, 1.5)
    want = ref.moe_experts_grouped(x, weights, ids, dense["w1"], dense["w2"], dense["w3"], 10.0).float()
    original = marlin_moe._permute_scales
    for label, fn in (("library", original), ("vllm", lambda mm_, parts, n, kk: vllm_scales(mm_, parts, n, kk))):
        marlin_moe._permute_scales = fn
        try:
            ex = marlin_moe.prepare(packed["w1"], packed["s1"], packed["w2"], packed["s2"], packed["w3"],
                                    packed["s3"])
            got = marlin_moe.marlin_moe(x, weights, ids, ex, 10.0).float()
            torch.cuda.synchronize()
            print(f"marlin scales {label}: rel {((got - want).norm() / want.norm()).item():.3e}")
        except Exception as exc:  # noqa: BLE001
            print(f"marlin scales {label}: failed {type(exc).__name__}: {exc}")
        finally:
            marlin_moe._permute_scales = original


if __name__ == "__main__":
    main()

"""CUDA-path checks and GPU training throughput, for a machine with a GPU.

    PYTHONPATH=src python benchmarks/gpu_check.py --out gpu_check.json

1. bf16 autocast forward on CUDA against an fp32 CPU reference (same weights);
2. the real Trainer on CUDA (precision auto -> bf16) for a few steps: the loss falls;
3. tokens/s and MFU of training steps (fixed R=5, full BPTT) for d=512 and the paper's S width
   at seq 2048, bf16, against the measured bf16 matmul peak; with the document mask and with plain
   causal attention (is_causal lets SDPA use the flash kernel);
4. torch.compile of the model: does it compile, and the step-time ratio.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from looplm.config import ModelConfig
from looplm.model import LoopedLM
from looplm.train.flops import flops_per_token


def matmul_peak(dtype, n=8192, reps=10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t)


def step_time(model, opt, x, depth, doc_ids, steps=6, warmup=3) -> float:
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, depth, doc_ids=doc_ids)
        loss = F.cross_entropy(out.logits.flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return sum(times) / len(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    args = ap.parse_args()
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    # 1. bf16 CUDA vs fp32 CPU
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=258, d_model=256, n_heads=4, n_kv_heads=2, ffn_dim=768, max_seq_len=512)
    m = LoopedLM(cfg).eval()
    x = torch.randint(0, 258, (2, 512))
    with torch.no_grad():
        ref = m(x, 5, init="seeded").logits
        m_gpu = m.to("cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = m_gpu(x.cuda(), 5, init="seeded").logits.float().cpu()
    res["bf16_vs_fp32_max_abs_logit_diff"] = float((got - ref).abs().max())
    res["bf16_vs_fp32_argmax_agreement"] = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    print("1.", res)

    # 2. the real Trainer on CUDA
    from looplm.train.config import job_preset
    from looplm.train.trainer import Trainer

    job = job_preset("tiny")
    job.train.precision = "auto"
    job.train.steps, job.train.progress, job.train.eval_every = 60, False, 0
    job.train.out_dir = Path("/tmp/gpu_run")
    job.train.checkpoint_every, job.train.tensorboard = 1000, False
    job.data.source, job.data.n_task_examples = "tasks", 20000  # as recorded: the preset trained on tasks then
    tr = Trainer(job)
    assert tr.dtype == torch.bfloat16, tr.dtype
    losses = [tr.train_step().loss for _ in range(60)]
    res["trainer_cuda_bf16_first_last_loss"] = [losses[0], sum(losses[-10:]) / 10]
    res["trainer_eval_loss"] = tr.evaluate()
    print("2.", res["trainer_cuda_bf16_first_last_loss"], res["trainer_eval_loss"])

    # 3. throughput and MFU
    peak = matmul_peak(torch.bfloat16)
    res["bf16_matmul_peak_tflops"] = peak / 1e12
    rows = []
    for name, cfg, B, L in [
        (
            "d512",
            ModelConfig(vocab_size=32768, d_model=512, n_heads=8, n_kv_heads=4, ffn_dim=1536, max_seq_len=2048),
            16,
            2048,
        ),
        (
            "S",
            ModelConfig(vocab_size=64256, d_model=1536, n_heads=24, n_kv_heads=6, ffn_dim=4352, max_seq_len=2048),
            8,
            2048,
        ),
    ]:
        torch.manual_seed(0)
        model = LoopedLM(cfg).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        x = torch.randint(0, cfg.vocab_size, (B, L), device="cuda")
        docs = torch.zeros(B, L, dtype=torch.long, device="cuda")
        fpt = flops_per_token(cfg, L, 5, None)
        for mask_name, doc_ids in [("causal", None), ("doc-mask", docs)]:
            dt = step_time(model, opt, x, 5, doc_ids)
            tps = B * L / dt
            rows.append(
                {"config": name, "attention": mask_name, "step_s": dt, "tokens_per_s": tps, "mfu": tps * fpt / peak}
            )
            print("3.", rows[-1])
        if name == "d512":
            try:
                cmodel = torch.compile(model)
                dt_c = step_time(cmodel, opt, x, 5, None, steps=6, warmup=3)
                res["compile_d512_step_ratio_eager_over_compiled"] = rows[-2]["step_s"] / dt_c
                res["compile_d512_mfu"] = B * L / dt_c * fpt / peak
            except Exception as err:  # report, don't hide
                res["compile_error"] = repr(err)[:500]
            print("4.", {k: v for k, v in res.items() if k.startswith("compile")})
        del model, opt
        torch.cuda.empty_cache()
    res["throughput"] = rows
    res["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

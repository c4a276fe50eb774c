"""Time and peak memory of one DP-SGD step over a non-private step, on the same model and batch, in one run.

For each model the script times, on the same batch and from the same weights:

* the non-private step: forward, backward, optimizer step;
* lightning-dp's DP step: `PerSampleClipper` (per-sample clipping, one forward + one backward),
  `PrivateStep` (noise + ledger in `GaussianRelease`, the optimizer step through `OptimizerTarget`);
* Opacus' DP step (PrivacyEngine.make_private: forward, backward, DPOptimizer.step) in each of its
  per-sample gradient modes, on the same model (BatchNorm replaced by GroupNorm, as Opacus requires).
  Modes that fail on the model are reported with their error.

Models (``--models``): ``resnet18`` and ``resnet50`` (GroupNorm; classification, batch 32), and segmentation networks on
per-pixel BCE (batch 8): ``unet``, ``fpn``, ``deeplabv3`` (smp, ResNet-18 encoder, random weights,
BatchNorm replaced by GroupNorm) and ``monai_unet`` (MONAI's UNet, channels 16-256, two residual
units per level: ConvTranspose2d, PReLU, InstanceNorm), ``monai_unet3d`` (the 3-D configs' UNet, channels
8-32, one residual unit per level, on 8 patches of ``size``³ voxels). ``--size`` is the image side (default 64;
the issue's target is U-Net at 128: DP step ≤ 1.5× the non-private time and memory).

Each variant runs in a fresh subprocess. Peak memory is the peak resident set size during its
second step above the size before its first (Linux ``/proc/self/status``, the high-water mark reset
through ``/proc/self/clear_refs`` between the two: the first step's own peak depends on the order of
first allocations, since glibc keeps freed memory), or the peak CUDA allocation of the first step on a
GPU; time is the median of ``--repeats`` later steps. Denormals are flushed to zero in every variant (as
the DP callbacks do on CPU).

Opacus modes that fail print their error instead of a time. Seen with Opacus 1.6 (CPU, size 32):
on the smp networks hooks, ghost and functorch fail on the in-place ReLU/residual additions
("Output 0 of BackwardHookFunction is a view and is being modified inplace"; Opacus issue #828)
and only ew runs; on ``monai_unet`` hooks and functorch run, ghost fails (its loss wrapper needs a
(B,) per-sample loss, a per-pixel loss is not one: "grad can be implicitly created only for scalar
outputs") and ew fails on PReLU ("Expanded Weights ... cannot handle function prelu"). Opacus issue
#671 reports crashes of older Opacus on MONAI's 3-D segmentation networks; with Opacus 1.6 a small
3-D UNet runs in the hooks and functorch modes.

Run: .venv/bin/python benchmarks/dpsgd_step.py [--models resnet18 unet fpn deeplabv3 monai_unet] [--size 64]
     [--repeats 5] [--device cpu|cuda]
Run it on an otherwise idle machine: torch's CPU threads slow down a lot under contention.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dp.accounting import PrivacyLedger
from lightning_dp.models import fix_model
from lightning_dp.models.classifier import build_backbone
from lightning_dp.sanitization import GaussianRelease
from lightning_dp.sanitization.per_sample import PerSampleClipper
from lightning_dp.training.step import OptimizerTarget, PrivateStep

CLIP, NOISE, LR = 1.0, 1.0, 0.05


MODELS = ("resnet18", "resnet50", "unet", "fpn", "deeplabv3", "monai_unet", "monai_unet3d")


def _model(name: str, size: int) -> tuple[nn.Module, tuple[int, ...], str]:
    if name == "resnet18":
        return build_backbone("resnet18", num_classes=2, norm="group"), (32, 3, size, size), "cls"
    if name == "resnet50":  # torchvision's ResNet-50 with GroupNorm (32 groups) in place of BatchNorm
        import torchvision

        net = torchvision.models.resnet50(num_classes=2, norm_layer=lambda c: nn.GroupNorm(32, c))
        return net, (32, 3, size, size), "cls"
    if name in ("unet", "fpn", "deeplabv3"):
        import segmentation_models_pytorch as smp

        arch = {"unet": smp.Unet, "fpn": smp.FPN, "deeplabv3": smp.DeepLabV3}[name]
        net = arch(encoder_name="resnet18", encoder_weights=None, classes=1)
        fix_model(net, warn=False)
        return net, (8, 3, size, size), "seg"
    if name == "monai_unet":
        from monai.networks.nets import UNet

        net = UNet(
            spatial_dims=2,
            in_channels=1,
            out_channels=1,
            channels=(16, 32, 64, 128, 256),
            strides=(2, 2, 2, 2),
            num_res_units=2,
        )
        return net, (8, 1, size, size), "seg"
    if name == "monai_unet3d":  # configs/segmentation_*_unet3d.yaml's network on a batch of 8 patches of size³
        from monai.networks.nets import UNet

        net = UNet(spatial_dims=3, in_channels=1, out_channels=1, channels=(8, 16, 32), strides=(2, 2), num_res_units=1)
        return net, (8, 1, size, size, size), "seg"
    raise SystemExit(f"unknown model {name!r}: use one of {', '.join(MODELS)}")


def _loss_fn(kind: str) -> nn.Module:
    return nn.CrossEntropyLoss() if kind == "cls" else nn.BCEWithLogitsLoss()


def _batch(shape: tuple[int, ...], kind: str, device: torch.device) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    y = torch.randint(0, 2, (shape[0],), generator=g) if kind == "cls" else (torch.rand(shape[0], 1, *shape[2:]) > 0.5)
    return x.to(device), (y.float() if kind == "seg" else y).to(device)


def _rss(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _reset_peak() -> None:
    """Resets this process's VmHWM to its current VmRSS (Linux: ``/proc/self/clear_refs``, value 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _measure(step: Callable[[], None], repeats: int, device: torch.device) -> tuple[float, float]:
    """(median seconds of ``repeats`` steps after warm-up steps, peak MiB of one step; on CUDA the first one)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - start) / 2**20
    else:
        # The peak of a later step above the memory before the first one: what training needs on top of the model
        # and the batch (gradient and sum buffers included). The first step's own high-water mark also depends on
        # the order of first allocations (glibc keeps freed memory), not on the step.
        start = _rss("VmRSS")
        step()
        _reset_peak()
        step()
        peak = (_rss("VmHWM") - start) / 2**20
    step()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    return statistics.median(times), peak


def _non_private(model: nn.Module, x: Tensor, y: Tensor, kind: str) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = _loss_fn(kind)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    return step


def _lightning_dp(model: nn.Module, x: Tensor, y: Tensor, kind: str) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = _loss_fn(kind)
    clipper = PerSampleClipper(model, CLIP, "mean")
    release = GaussianRelease(PrivacyLedger("sample", 1e-5), clip_norm=CLIP, sample_rate=0.01, schedule=NOISE, seed=0)
    private_step = PrivateStep(release)

    def step_optimizer() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    target = OptimizerTarget(model, clipper.params, [optimizer], step_optimizer)
    counter = [0]

    def step() -> None:
        clipper.reset()
        clipper.accumulate(lambda: loss_fn(model(x), y), x.shape[0])
        private_step(counter[0], clipper.flat_sum, float(x.shape[0]), target)
        counter[0] += 1

    return step


def _opacus(model: nn.Module, x: Tensor, y: Tensor, kind: str, mode: str) -> Callable[[], None]:
    from opacus import PrivacyEngine

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.cpu(), y.cpu()), batch_size=x.shape[0])
    engine = PrivacyEngine(accountant="rdp")
    made = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        criterion=_loss_fn(kind),
        data_loader=loader,
        noise_multiplier=NOISE,
        max_grad_norm=CLIP,
        poisson_sampling=False,
        grad_sample_mode=mode,
    )
    if mode == "ghost":
        dp_model, optimizer, criterion, _ = made
    else:
        (dp_model, optimizer, _), criterion = made, _loss_fn(kind)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        criterion(dp_model(x), y).backward()
        optimizer.step()

    return step


def _worker(name: str, variant: str, repeats: int, size: int, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    # Denormals flushed for every variant, as the DP callbacks do while fitting on CPU (a step of plain SGD
    # on this random data otherwise crawls through denormal gradients, which would flatter the ratios).
    torch.set_flush_denormal(True)
    model, shape, kind = _model(name, size)
    model.to(device)
    x, y = _batch(shape, kind, device)
    if variant == "non-private":
        step = _non_private(model, x, y, kind)
    elif variant == "lightning-dp":
        step = _lightning_dp(model, x, y, kind)
    else:
        step = _opacus(model, x, y, kind, variant.removeprefix("opacus-"))
    seconds, peak = _measure(step, repeats, device)
    return {"seconds": seconds, "peak_mib": peak, "parameters": sum(p.numel() for p in model.parameters())}


def _run(name: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", name, variant, "--repeats", str(args.repeats)]
    command += ["--size", str(args.size)]
    proc = subprocess.run([*command, "--device", args.device], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        return {"error": lines[-1][:90] if lines else f"exit {proc.returncode}"}
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18", "unet"], choices=MODELS)
    parser.add_argument("--size", type=int, default=64, help="image side in pixels (default 64)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--opacus-modes", nargs="+", default=["hooks", "ghost", "functorch", "ew"])
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.worker:
        name, variant = args.worker
        print(json.dumps(_worker(name, variant, args.repeats, args.size, torch.device(args.device))))
        return
    print(
        f"device {args.device}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"image {args.size}x{args.size}, repeats {args.repeats}"
    )
    for name in args.models:
        variants = ["non-private", "lightning-dp", *(f"opacus-{m}" for m in args.opacus_modes)]
        results = {v: _run(name, v, args) for v in variants}
        plain = results["non-private"]
        if "error" in plain:
            raise SystemExit(f"{name}: the non-private step failed: {plain['error']}")
        print(f"\n{name}, {plain['parameters']:,} parameters")
        print(f"  {'step':<18} {'time ms':>9} {'x non-private':>14} {'peak MiB':>9} {'x non-private':>14}")
        for variant, r in results.items():
            if "error" in r:
                print(f"  {variant:<18} {'-':>9} {'-':>14} {'-':>9} {'-':>14}  fails: {r['error']}")
                continue
            t, m = r["seconds"], r["peak_mib"]
            print(
                f"  {variant:<18} {1000 * t:9.1f} {t / plain['seconds']:14.2f} {m:9.0f} {m / plain['peak_mib']:14.2f}"
            )
        working = {v: r["seconds"] for v, r in results.items() if v.startswith("opacus") and "error" not in r}
        ours = results["lightning-dp"]
        if working and "error" not in ours:
            best = min(working, key=working.__getitem__)
            print(
                f"  lightning-dp vs Opacus' fastest working mode ({best}): "
                f"{ours['seconds'] / working[best]:.2f}x the time"
            )


if __name__ == "__main__":
    main()

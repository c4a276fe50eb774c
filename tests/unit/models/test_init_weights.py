"""`ImageClassifier(init_weights=...)`: starting from a file of public weights, and the errors for a wrong one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_dp.errors import PrivacyConfigError
from lightning_dp.models import ImageClassifier


def _public(seed: int = 0, **kwargs) -> ImageClassifier:
    torch.manual_seed(seed)
    return ImageClassifier(arch="small_cnn", **kwargs)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("what", ["module", "backbone", "lightning"])
def test_weights_load_from_a_state_dict_or_a_lightning_checkpoint(what: str, tmp_path: Path) -> None:
    public = _public(seed=1)
    path = tmp_path / "public.pt"
    if what == "module":
        torch.save(public.state_dict(), path)
    elif what == "backbone":
        torch.save(public.net.state_dict(), path)
    else:
        torch.save({"state_dict": public.state_dict(), "epoch": 3, "hyper_parameters": {"lr": 0.1}}, path)
    torch.manual_seed(2)  # another initialisation: only the file can make the weights equal
    loaded = ImageClassifier(arch="small_cnn", init_weights=str(path), trainable=["head"])
    assert _same_weights(loaded.net, public.net)
    assert [n for n, p in loaded.net.named_parameters() if p.requires_grad] == ["head.weight", "head.bias"]


def test_a_missing_file_names_the_public_pretraining_step(tmp_path: Path) -> None:
    with pytest.raises(PrivacyConfigError, match="no such file.*public_pretrain_synthetic.yaml"):
        ImageClassifier(arch="small_cnn", init_weights=str(tmp_path / "absent.ckpt"))


def test_weights_of_another_network_are_refused_with_the_keys(tmp_path: Path) -> None:
    path = tmp_path / "three_classes.pt"
    torch.save(_public(num_classes=3).state_dict(), path)
    with pytest.raises(
        PrivacyConfigError, match=r"2 of another shape .*head\.weight: \(3, 128\) in the file, \(2, 128\)"
    ):
        ImageClassifier(arch="small_cnn", init_weights=str(path))
    with pytest.raises(PrivacyConfigError, match="missing .*unexpected.*HINT: use the arch"):
        ImageClassifier(arch="resnet18", init_weights=str(path))


def test_a_file_that_is_not_a_state_dict_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not weights")
    with pytest.raises(PrivacyConfigError, match="weights_only=True"):
        ImageClassifier(arch="small_cnn", init_weights=str(tmp_path / "notes.txt"))
    torch.save({"epoch": 3}, tmp_path / "no_tensors.pt")
    with pytest.raises(PrivacyConfigError, match="no state dict of tensors"):
        ImageClassifier(arch="small_cnn", init_weights=str(tmp_path / "no_tensors.pt"))

"""Old name of `lightning_dp.pate.student`, kept for one release: import from `lightning_dp.pate`."""

from lightning_dp.pate.student import PATEStudentDataModule

__all__ = ["PATEStudentDataModule"]

"""Old name of `lightning_dp.pate.compression`, kept for one release: import from `lightning_dp.pate`."""

from lightning_dp.pate.compression import AutoencoderCompressor, Compressor, PCACompressor, check_maps

__all__ = ["AutoencoderCompressor", "Compressor", "PCACompressor", "check_maps"]

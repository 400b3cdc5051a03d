"""An offload row on a TPU topology compiled with ``--xla-dump``: its device footprint is the buffer assignment's HBM
total (exact), not the compiler's statistics' upper estimate (docs/tpu.md)."""

from __future__ import annotations

from jaxckpt.analysis import read_memory_spaces
from jaxckpt.report import build_report
from jaxckpt.step import shipped_target
from tests.extras import needs_libtpu

OFFLOAD = "save_and_offload_only_these_names:/decoder_layer_input"


@needs_libtpu
def test_an_offload_rows_device_bytes_come_from_the_buffer_assignment(tmp_path):
  target = shipped_target("llm", "llama-tiny", batch_size=8, seq_len=512, num_layers=8)
  plain = build_report(target, [OFFLOAD], topology="v5e:2x2", residuals=False, progress=False).row(OFFLOAD)
  dumped = build_report(target, [OFFLOAD], topology="v5e:2x2", residuals=False, progress=False,
                        xla_dump=str(tmp_path / "dump")).row(OFFLOAD)
  spaces = read_memory_spaces(dumped["xla_dump"]["dir"])
  assert dumped["host_footprint_bytes"] == plain["host_footprint_bytes"] == spaces.host_bytes > 0
  assert dumped["footprint_bytes"] == spaces.device_bytes  # the HBM total, to the byte
  # The statistics' figure is that total where their peak is the HBM's, and an upper estimate where it is the host's.
  assert spaces.device_bytes <= plain["footprint_bytes"]
  assert dumped["temp_bytes"] == spaces.device_bytes - dumped["argument_bytes"] - dumped["output_bytes"] + (
      dumped["alias_bytes"])

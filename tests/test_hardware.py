"""The GPUs ember knows (ember/hardware/): each spec read once into the figures the targets, the roofline and
MFU use, against the numbers written in the spec files' own comments and NVIDIA's datasheets."""

import pytest

from ember import hardware
from ember.plan import target as target_lib


@pytest.mark.parametrize("name,memory_gib,hbm_tb_s,kind,cc,cudnn,bf16", [
    ("h100", 79.1, 3.35, "NVIDIA H100 80GB HBM3", (9, 0), 90800, 989.0),
    ("h200", 139.9, 4.8, "NVIDIA H200", (9, 0), 90800, 989.0),
    ("b200", 178.4, 7.67, "NVIDIA B200", (10, 0), 92800, 2250.0),
])
def test_each_gpu_is_read_once_into_its_figures(name, memory_gib, hbm_tb_s, kind, cc, cudnn, bf16):
  gpu = hardware.gpu(name)
  assert gpu is hardware.gpu(name)  # Parsed once.
  assert round(gpu.memory_bytes / 2**30, 1) == memory_gib and round(gpu.hbm_bytes_per_s / 1e12, 2) == hbm_tb_s
  assert (gpu.device_kind, gpu.compute_capability, gpu.cudnn_version) == (kind, cc, cudnn)
  assert gpu.facts.tflops["bf16"] == bf16 and hardware.facts_for_kind(gpu.device_kind) == gpu.facts
  target = target_lib.parse(f"{name}x16")  # The target reads the same object.
  assert (target.device_memory_bytes, target.hbm_bytes_per_s, target.device_kind, target.compute_capability,
          target.facts) == (gpu.memory_bytes, gpu.hbm_bytes_per_s, kind, cc, gpu.facts)
  assert (target.nodes, target.per_node) == (2, 8)


@pytest.mark.parametrize("kind,bf16", [("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.5),
                                       ("NVIDIA H200 NVL", 835.5), ("NVIDIA H100 80GB HBM3", 989.0),
                                       ("NVIDIA H200", 989.0)])
def test_pcie_and_nvl_cards_are_not_taken_for_the_sxm_parts(kind, bf16):
  """The SXM rows' substrings match the PCIe and NVL cards' device_kind too: their MFU came out 16-24% low."""
  assert hardware.facts_for_kind(kind).tflops["bf16"] == bf16

"""clients/qat_mobilenet_meter_detached.py (the tutorial's QAT with the loss meter detached) with
the other default QAT qconfig, ``get_default_qat_qconfig('x86', version=0)``: the unfused
``FakeQuantize`` modules, whose Python ``forward`` branches on ``observer_enabled[0] == 1`` and
``fake_quant_enabled[0] == 1``, runs the ``MovingAverage(PerChannel)MinMaxObserver`` and copies the
new scale / zero-point into its buffers, instead of the fused ``FusedMovingAvgObsFakeQuantize``
op."""
from clients.qat_mobilenet import DEVICES, LICENSE, SOURCE, TAGS  # noqa: F401
from clients.qat_mobilenet import main as _main


def main(sg, steps=8, device="cpu", amp=None):
    _main(sg, steps=steps, device=device, amp=amp, detach_meter=True, qconfig_version=0)

"""The strategies a golden-test worker compares, made before any other TF op.

`golden_layouts("local", (2, 4))` splits the CPU into 4 logical devices and
returns {"one_device", "mirrored2", "mirrored4"}; "multi_worker" returns the
strategy of this worker's TF_CONFIG cluster.
"""

import tfmulti


def golden_layouts(mode, mirrored_sizes):
    if mode == "multi_worker":
        return {"multi_worker": tfmulti.create_strategy("multi_worker")}
    devices = tfmulti.simulate_devices(max(mirrored_sizes))
    layouts = {"one_device": tfmulti.create_strategy("one_device",
                                                     devices=devices[:1])}
    for n in mirrored_sizes:
        layouts[f"mirrored{n}"] = tfmulti.create_strategy(
            "mirrored", devices=devices[:n])
    return layouts

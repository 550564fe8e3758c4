"""One benchmark part in a fresh process, its figures as a JSON line.

TensorFlow fixes its devices (and a worker's collectives) once per process,
so `python -m tfmulti.bench` runs every device layout here:

    python -m tfmulti.bench.parts NAME '{"keyword": "arguments"}'

prints `RESULT_PREFIX` followed by the part's result as JSON on one line;
`run_part` is the parent's side: it starts such processes and reads them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

RESULT_PREFIX = "TFMULTI_BENCH_RESULT "


def _kill(proc):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def run_part(name, kwargs, *, timeout, envs=({},)):
    """Runs part `name` in one process per entry of `envs`, concurrently.

    Returns the parsed result of each process, in order. Every process is
    killed when the first fails, at `timeout`, or at the end.
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    command = [sys.executable, "-m", "tfmulti.bench.parts", name,
               json.dumps(kwargs)]
    procs = []
    try:
        for extra in envs:
            # This tfmulti, whichever is installed; quiet TensorFlow logs.
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **extra)
            env["PYTHONPATH"] = os.pathsep.join(
                [root] + [p for p in [os.environ.get("PYTHONPATH")] if p])
            procs.append(subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, start_new_session=True))
        outputs = []
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                out, _ = proc.communicate(
                    timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{name} {kwargs} ran past {timeout:.0f} s"
                                   " (--timeout)") from None
            if proc.returncode != 0:
                raise RuntimeError(f"{name} {kwargs} exited "
                                   f"{proc.returncode}:\n{out[-3000:]}")
            outputs.append(parse_result(out))
        return outputs
    finally:
        for proc in procs:
            _kill(proc)


def _step_overhead(**kwargs):
    from tfmulti.bench import step_overhead
    return step_overhead.run(**kwargs)


def _step_overhead_layouts(**kwargs):
    from tfmulti.bench import step_overhead
    return step_overhead.run_layouts(**kwargs)


def _input_pipeline(*, replicas, **kwargs):
    import tfmulti
    devices = tfmulti.simulate_devices(replicas)
    from tfmulti.bench import input_pipeline
    strategy = tfmulti.create_strategy("mirrored", devices=devices)
    return input_pipeline.measure(strategy, **kwargs)


def _communication(**kwargs):
    from tfmulti.bench import communication
    return communication.worker_main(**kwargs)


def _accumulation_memory(**kwargs):
    from tfmulti.bench import accumulation_memory
    return accumulation_memory.measure(**kwargs)


def _soak(**kwargs):
    from tfmulti.bench import soak
    return soak.run(**kwargs)


def _pipeline_bubble(**kwargs):
    from tfmulti.bench import pipeline_bubble
    return pipeline_bubble.measure(**kwargs)


def _communication_reduction(**kwargs):
    from tfmulti.bench import communication_reduction
    return communication_reduction.worker_main(**kwargs)


def _balance(**kwargs):
    from tfmulti.bench import balance
    return balance.worker_main(**kwargs)


PARTS = {
    "step_overhead": _step_overhead,
    "step_overhead_layouts": _step_overhead_layouts,
    "input_pipeline": _input_pipeline,
    "communication": _communication,
    "accumulation_memory": _accumulation_memory,
    "soak": _soak,
    "pipeline_bubble": _pipeline_bubble,
    "communication_reduction": _communication_reduction,
    "balance": _balance,
}


def parse_result(output: str) -> dict:
    """The result a part printed, from its whole output."""
    for line in reversed(output.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise ValueError("the part printed no result line; its output ends:\n"
                     + output[-3000:])


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2) or argv[0] not in PARTS:
        raise SystemExit(f"usage: python -m tfmulti.bench.parts "
                         f"{{{','.join(PARTS)}}} ['<JSON kwargs>'], got "
                         f"{argv!r}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    kwargs = json.loads(argv[1]) if len(argv) == 2 else {}
    result = PARTS[argv[0]](**kwargs)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""Trains the small CNN with Keras `model.fit` under a tfmulti strategy.

    python -m recipes.keras_fit --cpu_replicas=2            # laptop, CPU
    python -m recipes.keras_fit --num_gpus=8                # one GPU host
    tfmulti-launch --workers 2 -- python -m recipes.keras_fit   # N workers

Flags and wiring only; the run is `tfmulti.experiment.train_and_evaluate`.
"""

import os

# TensorFlow's C++ info lines (oneDNN, CPU features) on start; warnings and
# errors still show. Set TF_CPP_MIN_LOG_LEVEL=0 to see them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

from absl import flags as absl_flags  # noqa: E402

from tfmulti import flags  # noqa: E402

flags.define_flags()
# --help lists the recipe's flags (absl shows the main module's key flags).
absl_flags.adopt_module_key_flags(flags)
absl_flags.declare_key_flag("verbosity")
absl_flags.FLAGS["verbosity"].help = flags.VERBOSITY_HELP

if __name__ == "__main__":
    flags.run_recipe(loop="fit")

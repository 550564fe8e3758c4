"""Trains the small CNN with `tfmulti.Trainer` (explicit gradient reduction).

    python -m recipes.custom_loop --cpu_replicas=2 --grad_accum_steps=2
    tfmulti-launch --workers 2 -- python -m recipes.custom_loop

Flags and wiring only; the run is `tfmulti.experiment.train_and_evaluate`.
"""

from tfmulti import quiet_logging

if __name__ == "__main__":
    # Before TensorFlow is imported: its start-up lines off, real warnings
    # and errors kept; --verbosity shows everything.
    quiet_logging.quiet()

from absl import flags as absl_flags  # noqa: E402

from tfmulti import flags  # noqa: E402

flags.define_flags()
# --help lists the recipe's flags (absl shows the main module's key flags).
absl_flags.adopt_module_key_flags(flags)
absl_flags.declare_key_flag("verbosity")
absl_flags.FLAGS["verbosity"].help = flags.VERBOSITY_HELP

if __name__ == "__main__":
    flags.run_recipe(loop="trainer")

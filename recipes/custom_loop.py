"""Trains the small CNN with `tfmulti.Trainer` (explicit gradient reduction).

    python -m recipes.custom_loop --cpu_replicas=2 --grad_accum_steps=2
    tfmulti-launch --workers 2 -- python -m recipes.custom_loop

Flags and wiring only; the run is `tfmulti.experiment.train_and_evaluate`.
"""

from absl import app

from tfmulti import flags

flags.define_flags()

if __name__ == "__main__":
    app.run(flags.recipe_main(loop="trainer"))

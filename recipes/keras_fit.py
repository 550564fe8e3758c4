"""Trains the small CNN with Keras `model.fit` under a tfmulti strategy.

    python -m recipes.keras_fit --cpu_replicas=2            # laptop, CPU
    python -m recipes.keras_fit --num_gpus=8                # one GPU host
    tfmulti-launch --workers 2 -- python -m recipes.keras_fit   # N workers

Flags and wiring only; the run is `tfmulti.experiment.train_and_evaluate`.
"""

from absl import app

from tfmulti import flags

flags.define_flags()

if __name__ == "__main__":
    app.run(flags.recipe_main(loop="fit"))

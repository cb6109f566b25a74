"""Lightning training: models, the sampler-driven data module and the LightningModule."""

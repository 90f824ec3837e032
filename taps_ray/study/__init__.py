"""The study on Ray: the sweep's stages, Tune training, the mixture search, the evaluation actors and their pool."""

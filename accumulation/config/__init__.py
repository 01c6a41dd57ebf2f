"""The settings vocabulary: the typed config (config.py) and the keys every section declares, with their defaults,
units and limits (config_keys.py), and the registry where a model, a loss or a data source registers itself with its
own settings (registry.py). It imports nothing else of the package, so that the models, the data and the run can all
declare their settings with it."""

"""The settings vocabulary: the typed config, its keys and the registry a fork's pieces register in (README.md,
"Layout"). It imports only the maths, so that models/, data/ and run/ can all declare their settings with it."""

"""Model families, written only against op IDs. :mod:`.base` is the contract between engine and model;
:mod:`.registry` maps ``model.family`` to a loader."""

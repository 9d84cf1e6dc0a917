"""One module per served model family; `family.get_family` imports every module of this folder,
and each registers itself with `family.register_family`. A new family is a new file here."""

"""Running a recipe: the run directory and its policy (`session`), and the one driver that builds,
trains and closes a run (`driver.run`), in one process and in every launched worker alike.

May import the rest of `runtime` and `schema`; nothing in `runtime` imports it but the launcher.
"""

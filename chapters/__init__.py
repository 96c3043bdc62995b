"""Runnable walkthroughs, one per chapter of the study notes: ``python -m chapters.chNN_*``.

Each drives the real engine and prints what its chapter explains. They import
``nanoengine``; nothing in ``nanoengine`` imports them.
"""

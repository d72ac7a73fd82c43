"""The shipped skip profiles (data only: ``*.json``, see README.md here).

This folder installs as the package ``vllm_selfspec.profiles`` so that
:func:`vllm_selfspec.layers.profiles.shipped_profile_names` finds the files after ``pip install``
and in an editable install alike.
"""

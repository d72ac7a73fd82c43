"""Which sub-layers the draft skips: the profile schema and the shipped profiles, the offline
search (``search``), and online selection while serving (``online_search``, ``online_scoring``)."""

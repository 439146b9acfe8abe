"""One module per CRI verb weft intercepts, and the table of them (``routes``).

A verb never imports another verb: what several share lives in
``remote_calls`` (a remote container's calls on its host) and ``listing``
(the list verbs' filtering).
"""

"""The router's control side, what changes it while it serves: the admin token and
artifact reloads (:mod:`~eldr.proxy.control.admin`), the elastic decoder pool
(:mod:`~eldr.proxy.control.elastic`), learning from live traffic
(:mod:`~eldr.proxy.control.learning`, ``--learn``) and its admin routes
(:mod:`~eldr.proxy.control.learn_admin`). Each changes the routing state only through the
router's ``swap``; with ``--workers N`` through the pool journal (a :class:`JournalLink`).
"""

from eldr.proxy.control.admin import AdminToken, JournalLink, Reloader, ReloadRefused
from eldr.proxy.control.elastic import ElasticPool
from eldr.proxy.control.learn_admin import LearnAdmin
from eldr.proxy.control.learning import ForwardLearning, LiveLearning

__all__ = ["AdminToken", "ElasticPool", "ForwardLearning", "JournalLink", "LearnAdmin",
           "LiveLearning", "ReloadRefused", "Reloader"]

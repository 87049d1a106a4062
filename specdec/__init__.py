from specdec.resolvers import register as _register_resolvers

_register_resolvers()

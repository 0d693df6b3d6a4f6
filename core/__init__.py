"""The ground floor: typed settings (schema), config loading (loader), atomic files and run directories (files),
the user-error base class (errors); imports no other package of ours."""

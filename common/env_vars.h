// Every environment variable xctx reads: one table (name, what it does, its default) that
// `xctx doctor` prints with the values in force and docs/env_vars.md mirrors. A test
// (tests/check_env_table.py) fails when the sources read a variable the table does not name.
#pragma once

#include <cstddef>

namespace xctx {

struct env_var {
  const char* name;
  const char* meaning;
  const char* default_value;  // what applies when it is unset
};

// The table, in the order doctor prints it.
const env_var* env_vars(size_t* count);

}  // namespace xctx

// Catch2's main for dsrun_tests and dsrun_engine_tests, in a file of its own: a test file that
// defined it would have to include Catch before any helper header does.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

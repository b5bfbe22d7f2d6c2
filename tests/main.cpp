// Catch2's main for dsrun_tests.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

// UTF-8 and Unicode for tokenizers: decoding code points, repairing invalid UTF-8, normalisation
// (utf8proc), character classes as Rust's `char` defines them, and GPT-2's byte-to-character alphabet.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace dsrun::unicode {

// The code point starting at text[i] and its length in bytes. `text` must be valid UTF-8.
char32_t decode_at(std::string_view text, size_t i, int* length);
// Where the character ending just before byte `i` starts (i > 0; `text` valid UTF-8).
size_t previous_char_start(std::string_view text, size_t i);
// The code point at text[i] when a well-formed sequence starts there and ends inside `text`; false
// for anything else (a continuation byte, an ill-formed or cut-off sequence). For text of unknown
// validity, where decode_at would read a wrong character or past the end.
bool decode_checked(std::string_view text, size_t i, char32_t* cp, int* length);
void append_utf8(std::string& out, char32_t cp);
// Valid UTF-8, invalid sequences replaced by U+FFFD one per maximal subpart (Unicode's
// recommended practice; Rust's from_utf8_lossy and JavaScript's TextDecoder do the same).
bool is_valid_utf8(std::string_view text);
std::string repair_utf8(std::string_view text);

// Rust's char::is_whitespace (the White_Space property), char::is_numeric (categories Nd, Nl, No),
// char::is_alphanumeric (approximated as letters and numbers), and punctuation (categories P*).
bool is_whitespace(char32_t cp);
bool is_numeric(char32_t cp);
bool is_alphanumeric(char32_t cp);
bool is_punctuation(char32_t cp);
bool is_nonspacing_mark(char32_t cp);  // category Mn (StripAccents removes them)
bool is_letter(char32_t cp);           // categories Lu, Ll, Lt, Lm, Lo: what \p{L} matches

enum class NormalForm { nfc, nfd, nfkc, nfkd };
std::string normalize(std::string_view text, NormalForm form);
// Full lowercase mapping as Rust's str::to_lowercase (İ -> i + U+0307, final sigma -> ς).
std::string lowercase(std::string_view text);

// GPT-2's reversible map from bytes to printable characters (byte-level BPE vocabularies are
// written in it): byte b -> UTF-8 of its character; and back (-1 for characters outside it).
const std::array<std::string, 256>& byte_to_char();
int char_to_byte(char32_t cp);

}  // namespace dsrun::unicode

// UTF-8, normalisation and character classes for the tokenizers (see unicode.hpp).
#include "engine/tokenizer/unicode.hpp"

#include "engine/common/error.hpp"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>

namespace dsrun::unicode {

char32_t decode_at(std::string_view text, size_t i, int* length) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(text[i + k]); };
  const unsigned char c = b(0);
  if (c < 0x80) { *length = 1; return c; }
  if (c < 0xE0) { *length = 2; return (char32_t(c & 0x1F) << 6) | (b(1) & 0x3F); }
  if (c < 0xF0) { *length = 3; return (char32_t(c & 0x0F) << 12) | (char32_t(b(1) & 0x3F) << 6) | (b(2) & 0x3F); }
  *length = 4;
  return (char32_t(c & 0x07) << 18) | (char32_t(b(1) & 0x3F) << 12) | (char32_t(b(2) & 0x3F) << 6) | (b(3) & 0x3F);
}

size_t previous_char_start(std::string_view text, size_t i) {
  size_t k = i - 1;
  while (k > 0 && (static_cast<unsigned char>(text[k]) & 0xC0) == 0x80) --k;
  return k;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

namespace {
// Length of the well-formed sequence at text[i] (Unicode Table 3-7), or 0 with *subpart set to
// the length of its maximal ill-formed prefix (at least 1).
int well_formed_length(std::string_view text, size_t i, int* subpart) {
  const size_t n = text.size();
  const auto at = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char c = at(i);
  *subpart = 1;
  if (c < 0x80) return 1;
  int need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) need = 1;
  else if (c == 0xE0) { need = 2; lo = 0xA0; }
  else if (c == 0xED) { need = 2; hi = 0x9F; }
  else if (c >= 0xE1 && c <= 0xEF) need = 2;
  else if (c == 0xF0) { need = 3; lo = 0x90; }
  else if (c == 0xF4) { need = 3; hi = 0x8F; }
  else if (c >= 0xF1 && c <= 0xF3) need = 3;
  else return 0;
  for (int k = 1; k <= need; ++k) {
    if (i + k >= n) { *subpart = k; return 0; }
    const unsigned char d = at(i + k);
    const bool ok = k == 1 ? (d >= lo && d <= hi) : (d >= 0x80 && d <= 0xBF);
    if (!ok) { *subpart = k; return 0; }
  }
  return need + 1;
}
}  // namespace

bool decode_checked(std::string_view text, size_t i, char32_t* cp, int* length) {
  if (i >= text.size()) return false;
  int subpart;
  const int len = well_formed_length(text, i, &subpart);
  if (len == 0) return false;
  *cp = decode_at(text, i, length);
  return true;
}

bool is_valid_utf8(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    if (static_cast<unsigned char>(text[i]) < 0x80) { ++i; continue; }
    int subpart;
    const int len = well_formed_length(text, i, &subpart);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

std::string repair_utf8(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 8);
  for (size_t i = 0; i < text.size();) {
    int subpart;
    const int len = well_formed_length(text, i, &subpart);
    if (len > 0) {
      out.append(text.substr(i, len));
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      i += subpart;
    }
  }
  return out;
}

bool is_whitespace(char32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  switch (cp) {
    case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

bool is_numeric(char32_t cp) {
  const auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
}

bool is_alphanumeric(char32_t cp) {
  const auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO) ||
         (c >= UTF8PROC_CATEGORY_ND && c <= UTF8PROC_CATEGORY_NO);
}

bool is_punctuation(char32_t cp) {
  const auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return c >= UTF8PROC_CATEGORY_PC && c <= UTF8PROC_CATEGORY_PO;
}

bool is_letter(char32_t cp) {
  const auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO;
}

bool is_nonspacing_mark(char32_t cp) {
  return utf8proc_category(static_cast<utf8proc_int32_t>(cp)) == UTF8PROC_CATEGORY_MN;
}

std::string normalize(std::string_view text, NormalForm form) {
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::nfc: options |= UTF8PROC_COMPOSE; break;
    case NormalForm::nfd: options |= UTF8PROC_DECOMPOSE; break;
    case NormalForm::nfkc: options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case NormalForm::nfkd: options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
  }
  utf8proc_uint8_t* mapped = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                          static_cast<utf8proc_ssize_t>(text.size()), &mapped,
                                          static_cast<utf8proc_option_t>(options));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owner(mapped, &std::free);
  if (n < 0) fail_at(__FILE__, __LINE__, std::string("utf8proc_map: ") + utf8proc_errmsg(n));
  return std::string(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n));
}

namespace {
bool is_cased(char32_t cp) {
  const auto c = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
  return c == UTF8PROC_CATEGORY_LU || c == UTF8PROC_CATEGORY_LL || c == UTF8PROC_CATEGORY_LT;
}
}  // namespace

std::string lowercase(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  char32_t previous = 0;
  for (size_t i = 0; i < text.size();) {
    int len;
    const char32_t cp = decode_at(text, i, &len);
    if (cp < 0x80) {
      out += static_cast<char>(cp >= 'A' && cp <= 'Z' ? cp + 32 : cp);
    } else if (cp == 0x130) {  // İ: the one unconditional multi-character lowercase mapping
      out += "i\xCC\x87";
    } else if (cp == 0x3A3) {  // Σ: final form after a cased letter when no cased letter follows
      bool next_cased = false;
      if (i + len < text.size()) {
        int next_len;
        next_cased = is_cased(decode_at(text, i + len, &next_len));
      }
      append_utf8(out, previous != 0 && is_cased(previous) && !next_cased ? 0x3C2 : 0x3C3);
    } else {
      append_utf8(out, static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))));
    }
    previous = cp;
    i += len;
  }
  return out;
}

namespace {
struct ByteAlphabet {
  std::array<std::string, 256> to_char;
  std::array<int16_t, 512> from_char;  // every character of the alphabet is below U+0200
  ByteAlphabet() {
    from_char.fill(-1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t cp = printable ? char32_t(b) : char32_t(256 + extra++);
      append_utf8(to_char[b], cp);
      from_char[cp] = static_cast<int16_t>(b);
    }
  }
};
const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet alphabet;
  return alphabet;
}
}  // namespace

const std::array<std::string, 256>& byte_to_char() { return byte_alphabet().to_char; }

int char_to_byte(char32_t cp) { return cp < 512 ? byte_alphabet().from_char[cp] : -1; }

}  // namespace dsrun::unicode

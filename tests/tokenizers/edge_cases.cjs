// Writes the tokenizer tests' edge cases, one per line: emoji and combining marks, long digit
// and whitespace runs, CRLF, invalid UTF-8, special tokens inside text, a 1 MB line.
// usage: node edge_cases.cjs OUT_FILE TOKENIZER_JSON (its first two and last added tokens are used)
const fs = require("fs");
const [out, tokenizerJson] = process.argv.slice(2);
const added = JSON.parse(fs.readFileSync(tokenizerJson, "utf8")).added_tokens || [];
const specials = [...new Set([added[0], added[1], added[added.length - 1]].filter(Boolean).map((t) => t.content))];
const lines = [
  "Hello, world! I'm here; you're there, we'll see. It's JSON's \"quote\".",
  "emoji: 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🤖🤖🤖",
  "combining: e\u0301 a\u0308 n\u0303 \u0915\u094D\u0937 Ä Å é",
  "digits: 1 12 123 1234 12345 3.14159265358979 " + "9".repeat(200) + " ١٢٣٤ ½ ²",
  "spaces:  two   three    four\tt\t\ttabs" + " ".repeat(300) + "end",
  "   leading and trailing   ",
  "windows line\r",
  "\r\r\r",
  "mixed\u00A0nbsp\u2009thin\u3000ideographic\u200Bzwsp",
  "CJK: 你好世界。日本語のテキスト、カタカナ。한국어 텍스트.",
  "Ελληνικά ΣΊΣΥΦΟΣ Русский текст ÀÉÎÕÜ İstanbul",
  "code: for (int i = 0; i < n; ++i) { x[i] += y[i] * 2; } // done",
  "urls: https://example.com/a/b?c=d&e=f#g user@example.org",
  "punct: ... --- !!! ??? ((( ))) <<<>>> ~~~ ``` '''",
  "contractions: I'M YOU'RE he'S She'll They'VE we'd DON'T",
  "",
  "x",
];
for (const s of specials) lines.push(`before${s}after ${s} ${s}${s} text`);
const buffers = lines.map((l) => Buffer.from(l + "\n", "utf8"));
// Invalid UTF-8: a lone continuation byte, a truncated sequence, an overlong form, a surrogate.
buffers.push(Buffer.concat([Buffer.from("bad: "), Buffer.from([0x80, 0x41, 0xe2, 0x82, 0x20, 0xc0, 0xaf, 0xed, 0xa0, 0x80, 0xff]), Buffer.from(" end\n")]));
// A 1 MB line of prose-like text.
const words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "1234", "naïve", "café", "—", "don't"];
let big = "";
for (let i = 0; big.length < 1 << 20; ++i) big += words[(i * 7919) % words.length] + (i % 17 === 0 ? ", " : " ");
buffers.push(Buffer.from(big + "\n", "utf8"));
fs.writeFileSync(out, Buffer.concat(buffers));

// Checks `dsrun tokenize --decode` output against the text it came from: line by line equal to
// the text read as UTF-8 (invalid bytes as U+FFFD), NFC-normalised with --nfc (tokenizers that
// normalise cannot give back what they changed); with --skip-added TOKENIZER_JSON, lines holding
// one of its added tokens are left out. usage: node roundtrip.cjs TEXT DECODED [--nfc | --skip-added FILE]
const fs = require("fs");
const [textFile, decodedFile, flag, tokenizerJson] = process.argv.slice(2);
const added = flag === "--skip-added" ? JSON.parse(fs.readFileSync(tokenizerJson, "utf8")).added_tokens.map((t) => t.content) : [];
const expected = fs.readFileSync(textFile).toString("utf8").split("\n");
const decoded = fs.readFileSync(decodedFile).toString("utf8").split("\n");
if (expected.length !== decoded.length) {
  console.error(`roundtrip: ${expected.length} lines of text, ${decoded.length} decoded`);
  process.exit(1);
}
let bad = 0;
for (let i = 0; i < expected.length; ++i) {
  const want = flag === "--nfc" ? expected[i].normalize("NFC") : expected[i];
  if (added.some((t) => expected[i].includes(t))) continue;
  if (want !== decoded[i]) {
    if (++bad <= 3) console.error(`roundtrip: line ${i + 1} differs:\n  text:    ${JSON.stringify(want.slice(0, 200))}\n  decoded: ${JSON.stringify(decoded[i].slice(0, 200))}`);
  }
}
if (bad) { console.error(`roundtrip: ${bad} lines differ`); process.exit(1); }
console.log(`roundtrip: ${expected.length} lines decode to their text`);

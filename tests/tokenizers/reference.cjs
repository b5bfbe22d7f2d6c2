// The reference for dsrun's tokenizer tests: Hugging Face's JavaScript tokenizers
// (@huggingface/tokenizers, fetched by setup.sh --with-test-tools, never committed).
// usage: node reference.cjs NODE_MODULES TOKENIZER_DIR FILE [--special]
// Prints one JSON array of ids per line of FILE (lines split on \n only, as `dsrun tokenize`).
const fs = require("fs");
const path = require("path");
const [modules, dir, file, flag] = process.argv.slice(2);
const { Tokenizer } = require(path.resolve(modules, "@huggingface/tokenizers"));
const json = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8"));
const configPath = path.join(dir, "tokenizer_config.json");
const config = fs.existsSync(configPath) ? JSON.parse(fs.readFileSync(configPath, "utf8")) : {};
const tokenizer = new Tokenizer(json, config);
// Invalid UTF-8 becomes U+FFFD per maximal subpart here (WHATWG), as dsrun repairs it.
const text = fs.readFileSync(file).toString("utf8");
const lines = text.split("\n");
if (lines.length && lines[lines.length - 1] === "") lines.pop();
const out = [];
for (const line of lines) {
  const ids = tokenizer.encode(line, { add_special_tokens: flag === "--special" }).ids;
  out.push("[" + ids.join(",") + "]");
}
fs.writeFileSync(1, out.join("\n") + (out.length ? "\n" : ""));
